"""Model resolution, integrity checks and prompt-set splits; no network, tiny models only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mtplm.assets import datasets
from mtplm.assets import models as assets
from mtplm.assets.models import (
    AssetError,
    concat_verified,
    model_identity,
    resolve_model,
    sha256_file,
    verify_sha256,
)
from mtplm.errors import UserError
from mtplm.files import home

INSTALLED_CACHE = home()  # read before the fixture below points MTPLM_HOME at a temp dir


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "mtplm-home"
    monkeypatch.setenv("MTPLM_HOME", str(home))
    return home


def test_home_follows_env(private_cache: Path) -> None:
    assert home() == private_cache


def test_missing_model_is_a_user_error_with_guidance(tmp_path: Path) -> None:
    with pytest.raises(AssetError) as caught:
        resolve_model(str(tmp_path / "no-such-model"))
    message = str(caught.value)
    assert "not found" in message and "smollm2-135m" in message and ".gguf" in message
    assert isinstance(caught.value, UserError) and isinstance(caught.value, ValueError)


def test_misspelled_registry_name_suggests_the_right_one() -> None:
    with pytest.raises(AssetError, match="did you mean 'smollm2-135m'"):
        resolve_model("smollm2-135")


def test_directory_without_config_and_non_gguf_file_are_rejected(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(AssetError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(AssetError, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"))
    (tmp_path / "fake.gguf").write_text("not a model")
    with pytest.raises(AssetError, match="not a GGUF file"):
        resolve_model(str(tmp_path / "fake.gguf"))


def test_local_hf_directory_resolves_to_itself(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "tiny")
    assert resolve_model(str(tmp_path / "tiny")) == (tmp_path / "tiny").resolve()
    identity = model_identity(tmp_path / "tiny")
    assert identity == {"name": "tiny", "sha256": None}  # no machine path in a checkpoint's record


def test_identity_comes_from_the_conversion_record(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / assets.SOURCE_FILE).write_text(
        json.dumps({"name": "smollm2-135m", "sha256": "ab" * 32})
    )
    assert model_identity(tmp_path / "m")["name"] == "smollm2-135m"
    assert model_identity(tmp_path / "m")["sha256"] == "ab" * 32


def test_a_checkpoints_base_resolves_by_registry_name_and_checksum(private_cache: Path) -> None:
    """Another machine's model home: the record's old absolute path is gone; name + sha256 find the base."""
    entry = assets.MODELS[assets.DEFAULT_MODEL]
    installed = private_cache / "models" / entry.name
    installed.mkdir(parents=True)
    (installed / assets.SOURCE_FILE).write_text(json.dumps({"name": entry.name, "sha256": entry.sha256}))
    record = {
        "name": entry.name,
        "sha256": entry.sha256,
        "path": "/elsewhere/models/smollm2-135m",
        "spec": entry.name,
    }
    assert assets.base_model_dir(record) == installed
    assert assets.base_model_dir({**record, "sha256": "ab" * 32}) is None  # another model under that name
    from types import SimpleNamespace

    from mtplm.bench import llama_server

    model = SimpleNamespace(meta=SimpleNamespace(base_model=record), hf=SimpleNamespace(name_or_path="x"))
    assert llama_server.base_dir(model) == installed  # bench --llama-server's q4 GGUF lookup starts here
    (installed / assets.SOURCE_FILE).write_text(json.dumps({"name": entry.name, "sha256": "cd" * 32}))
    assert assets.base_model_dir(record) is None  # the installed model is not the one trained on


def test_an_old_checkpoints_recorded_path_still_resolves(tmp_path: Path) -> None:
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")
    assert (
        assets.base_model_dir({"name": "base", "sha256": None, "path": str(tmp_path / "base")})
        == tmp_path / "base"
    )


def test_the_shipped_checkpoint_records_no_machine_path() -> None:
    from mtplm.modelio import SHIPPED

    for meta in SHIPPED.glob("*/mtplm.json"):
        record = json.loads(meta.read_text())
        assert "path" not in record["base_model"], meta
        assert not any(str(v).startswith(("/", "~")) for v in record["base_model"].values()), meta


def test_sha256_check_rejects_a_corrupted_file(tmp_path: Path) -> None:
    good = tmp_path / "model.gguf"
    good.write_bytes(b"GGUF" + bytes(range(256)))
    expected = sha256_file(good)
    verify_sha256(good, expected)
    good.write_bytes(b"GGUF" + bytes(range(255)) + b"\x00")
    with pytest.raises(AssetError, match="corrupt"):
        verify_sha256(good, expected)


def test_chunks_concatenate_in_order_and_a_bad_result_leaves_nothing(tmp_path: Path) -> None:
    parts = []
    for i, payload in enumerate((b"first-", b"second-", b"third")):
        parts.append(tmp_path / f"part{i}.bin")
        parts[-1].write_bytes(payload)
    whole = tmp_path / "whole.bin"
    whole.write_bytes(b"first-second-third")
    target = tmp_path / "cache" / "assembled.gguf"
    assert concat_verified(parts, target, sha256_file(whole)).read_bytes() == b"first-second-third"
    bad_target = tmp_path / "cache" / "reversed.gguf"
    with pytest.raises(AssetError):
        concat_verified(parts[::-1], bad_target, sha256_file(whole))
    assert not bad_target.exists() and not list(bad_target.parent.glob(".*partial*"))


def test_registry_requirements_files_pin_hashes() -> None:
    for entry in assets.MODELS.values():
        text = assets.requirements_file(entry.requirements).read_text()
        assert "--hash=sha256:" in text
    assert assets.DEFAULT_MODEL in assets.MODELS


def test_truncated_json_array_yields_the_complete_objects(tmp_path: Path) -> None:
    items = [{"id": f"c{i}", "text": "x" * (i * 7)} for i in range(40)]
    text = json.dumps(items, indent=1)
    truncated = tmp_path / "truncated.json"
    truncated.write_text(text[: text.index('"c39"') + 10])  # cut inside the last object
    assert list(datasets.iter_json_array(truncated, chunk_chars=64)) == items[:39]
    complete = tmp_path / "complete.json"
    complete.write_text(text)
    assert list(datasets.iter_json_array(complete, chunk_chars=50)) == items


def test_split_is_a_stable_partition() -> None:
    ids = [f"source/{i}" for i in range(2000)]
    train = {i for i in ids if datasets.in_split(i, "train")}
    evaluation = {i for i in ids if datasets.in_split(i, "eval")}
    assert not train & evaluation and train | evaluation == set(ids)
    assert 800 < len(evaluation) < 1200
    assert train == {i for i in ids if datasets.in_split(i, "train")}
    with pytest.raises(AssetError):
        datasets.in_split("x", "validation")


def _data_installed() -> bool:
    return all(assets.package_file(*location) is not None for location in datasets._FILES.values())


@pytest.mark.slow
@pytest.mark.skipif(
    not _data_installed(), reason="data packages not installed: run mtplm.datasets.install_data()"
)
def test_prompt_set_train_and_eval_never_overlap() -> None:
    for name, n in (
        ("gsm8k", 200),
        ("humaneval", 40),
        ("mtbench", 30),
        ("sharegpt", 300),
        ("mixed", 120),
        ("structured", 20),
    ):
        train = {e.id for e in datasets.prompt_set(name, n, seed=1, split="train")}
        evaluation = {e.id for e in datasets.prompt_set(name, n, seed=2, split="eval")}
        assert len(train) == len(evaluation) == n, name
        assert not train & evaluation, name
        assert train == {e.id for e in datasets.prompt_set(name, n, seed=1, split="train")}, name
    listed = datasets.prompt_set("gsm8k,humaneval,structured", 13, seed=0, split="eval")
    sources = [e.id.split("/")[0] for e in listed]
    assert (sources.count("gsm8k"), sources.count("HumanEval"), sources.count("structured")) == (4, 4, 5)
    full = datasets.prompt_set("gsm8k,humaneval", None, seed=0, split="eval")
    assert {e.id for e in full} == {
        e.id for e in datasets.gsm8k() + datasets.humaneval() if datasets.in_split(e.id, "eval")
    }
    with pytest.raises(AssetError, match="explicit count"):
        datasets.prompt_set("gsm8k,sharegpt", None)
    with pytest.raises(AssetError, match="unknown prompt set"):
        datasets.prompt_set("gsm8k,wikitext", 4)
    answers = [e.answer for e in datasets.gsm8k()]
    assert len(answers) == 1319 and all(a and a.lstrip("-").replace(".", "").isdigit() for a in answers)


@pytest.mark.slow
def test_installed_default_model_has_a_chat_template() -> None:
    folder = INSTALLED_CACHE / "models" / assets.DEFAULT_MODEL
    if not (folder / assets.SOURCE_FILE).is_file():
        pytest.skip(
            f"{assets.DEFAULT_MODEL} not installed: run mtplm.assets.install_model('{assets.DEFAULT_MODEL}')"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "hi" in text and model_identity(folder)["sha256"] == assets.MODELS[assets.DEFAULT_MODEL].sha256
