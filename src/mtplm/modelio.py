"""Reading and writing converted checkpoints: metadata, full, delta and head-based forms, shipped names.

A converted checkpoint is an ordinary HF checkpoint (loads with `AutoModelForCausalLM.from_pretrained`)
with `mtplm.json` beside it; gated-LoRA adapters, which plain HF cannot express, sit in
`gated_lora.safetensors`. A *delta* checkpoint stores only what conversion added (the mask token's
rows and the adapters) and names its base model; it is what ships inside the package. A head-based
checkpoint holds the heads' weights and names its base model.

This module knows the files, not the model class: the writers take an MTPModel without importing it, and
model.load_model (above) builds one from what these files hold.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from mtplm import lora
from mtplm.config import Thresholds
from mtplm.errors import UserError
from mtplm.files import atomic_dir

MASK_TOKEN = "<mtp>"
META_FILE = "mtplm.json"
ADAPTER_FILE = "gated_lora.safetensors"
HEADS_FILE = "heads.safetensors"
DELTA_FILE = "delta.safetensors"
SHIPPED = Path(__file__).parent / "checkpoints"
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@dataclass
class MTPMeta:
    """What mtplm records beside a converted checkpoint."""

    mask_id: int | None  # None for head-based checkpoints (no mask token)
    method: str = "mask"  # mask | heads
    mask_token: str = MASK_TOKEN
    k_max: int = Thresholds.k_max  # the one k_max (thresholds below hold no second copy)
    trainable: str = "gated-lora"
    lora_rank: int = 0
    lora_alpha: float = 0.0
    thresholds: dict = field(default_factory=lambda: Thresholds().to_json())
    base_model: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)
    delta: bool = False
    heads: dict = field(
        default_factory=dict
    )  # method "heads": heads.Heads config (form, k, dim, intermediate)
    format_version: int = 1

    def decode_thresholds(self) -> Thresholds:
        """The decoding defaults this checkpoint records, typed (config.Thresholds)."""
        return Thresholds.from_json(self.thresholds, self.k_max)


def save_heads(model, out_dir: str | os.PathLike) -> Path:
    """A head-based checkpoint: the heads' weights and metadata naming the base model. Atomic."""

    def write(tmp: Path) -> None:
        state = {k: v.float() if v.is_floating_point() else v for k, v in model.heads.state_dict().items()}
        save_file(_contiguous(state), tmp / HEADS_FILE)
        write_meta(tmp, model.meta)

    return atomic_dir(Path(out_dir), write)


def save(model, out_dir: str | os.PathLike) -> Path:
    """A full checkpoint: HF weights (LoRA merged), tokenizer, adapters, metadata. Atomic."""

    def write(tmp: Path) -> None:
        model.hf.save_pretrained(tmp, state_dict=_base_state(model.hf))
        model.tokenizer.save_pretrained(tmp)
        if model.gate is not None:
            save_file(_contiguous(lora.adapter_state(model.hf)), tmp / ADAPTER_FILE)
        write_meta(tmp, model.meta)

    return atomic_dir(Path(out_dir), write)


def save_delta(model, out_dir: str | os.PathLike, base_spec: str) -> Path:
    """Only what conversion added (mask rows + gated adapters), naming the base model. Atomic."""
    if model.meta.trainable != "gated-lora":
        raise UserError("a delta checkpoint holds adapters; use save() for full or merged-LoRA models")
    mask_id = model.meta.mask_id
    tensors = {"mask_embedding": model.hf.get_input_embeddings().weight[mask_id].float()}
    head = model.hf.get_output_embeddings().weight
    if head.data_ptr() != model.hf.get_input_embeddings().weight.data_ptr():
        tensors["mask_head_row"] = head[mask_id].float()
    tensors.update(lora.adapter_state(model.hf))
    meta = MTPMeta(**{**asdict(model.meta), "delta": True})
    meta.base_model = {**meta.base_model, "spec": base_spec}

    def write(tmp: Path) -> None:
        # adapters in float16 keep the shipped file small; the mask rows stay float32
        save_file(
            _contiguous({k: v.half() if ".lora_" in k else v for k, v in tensors.items()}), tmp / DELTA_FILE
        )
        write_meta(tmp, meta)

    return atomic_dir(Path(out_dir), write)


def _base_state(hf) -> dict[str, torch.Tensor]:
    """The HF state dict without our adapter tensors, under the names HF expects."""
    state = {}
    for name, value in hf.state_dict().items():
        if ".lora_" in name:
            continue
        state[name.replace(".base.weight", ".weight").replace(".base.bias", ".bias")] = value
    return state


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in tensors.items()}


def write_meta(directory: Path, meta: MTPMeta) -> None:
    (directory / META_FILE).write_text(json.dumps(asdict(meta), indent=2) + "\n")


def read_meta(directory: Path) -> MTPMeta:
    try:
        return MTPMeta(**json.loads((directory / META_FILE).read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise UserError(f"{directory / META_FILE} is not a readable mtplm metadata file: {exc}") from None


def shipped(spec: str) -> Path | None:
    """The directory of a checkpoint shipped inside the package under that name, if there is one."""
    folder = SHIPPED / str(spec)
    return folder if str(spec) and "/" not in str(spec) and (folder / META_FILE).is_file() else None


def checkpoint_dir(spec: str) -> Path:
    """The directory of a converted checkpoint given by shipped name or path (UserError if it is none)."""
    path = shipped(spec) or Path(spec)
    if not (path / META_FILE).is_file():
        raise UserError(
            f"{spec} is not a converted checkpoint (no {META_FILE}): convert it with `mtplm train`"
        )
    return path


def weight_files(directory: Path) -> list[Path] | None:
    """The safetensors files holding a Hugging Face model's weights (one, or the shards its index names);
    None where it has none."""
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        return None
    return [directory / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]


def read_weights(files: list[Path], dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """Every tensor of safetensors `files` in `dtype`, read one tensor at a time by plain file reads; None
    if one is stored in a dtype other than float32, bfloat16 or float16.

    Hugging Face's loader maps each file and converts from the map: every page it touched stays in the
    process's resident set until the load ends, so a float32 file loaded as bf16 peaks at 1.5x the file
    plus the model (10.8 GB for Qwen2.5-1.5B, whose bf16 weights are 3.6 GB). Here the peak is the model
    plus the largest tensor as stored."""
    headers = [_safetensors_header(file) for file in files]
    if any(info["dtype"] not in _SAFETENSORS_DTYPES for _, header in headers for info in header.values()):
        return None
    tensors: dict[str, torch.Tensor] = {}
    for file, (start, header) in zip(files, headers, strict=True):
        with open(file, "rb", buffering=0) as stream:
            for name, info in header.items():
                begin, end = info["data_offsets"]
                raw = bytearray(end - begin)
                stream.seek(start + begin)
                stream.readinto(raw)
                stored = _SAFETENSORS_DTYPES[info["dtype"]]
                tensor = torch.frombuffer(raw, dtype=stored) if raw else torch.empty(0, dtype=stored)
                tensor = tensor.reshape(info["shape"])
                # `tensor` is a view of `raw`: a conversion copies; in the same dtype the view is kept
                tensors[name] = tensor.to(dtype) if stored != dtype else tensor
    return tensors


def _safetensors_header(file: Path) -> tuple[int, dict]:
    """(where the data of safetensors `file` begins, its tensors' entries: name -> dtype, shape, offsets)."""
    with open(file, "rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
        header = json.loads(stream.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header
