"""Training checkpoints and configs: atomic train_state, a full disk, bad input, the TOML round trip."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import tiny_mtp, tiny_tokenizer
from synthetic import chain_rows, train_config, write_rows

from mtplm.config import TrainConfig, load_train_config, to_toml
from mtplm.errors import UserError
from mtplm.model import MTPModel
from mtplm.train.checkpoint import STATE_DIR, load_train_state
from mtplm.train.trainer import train

QUICK = dict(
    k_max=4,
    batch_size=8,
    seq_len=32,
    slots_per_seq=12,
    region_width=8,
    lora_rank=4,
    lora_alpha=8.0,
    val_every=1000,
    warmup_steps=2,
)


def _leftovers(run_dir: Path) -> list[str]:
    """Temporary folders and files of atomic writes (named .<target>.<random>)."""
    return [p.name for p in run_dir.iterdir() if p.name.startswith(".")]


def test_full_disk_keeps_the_previous_train_state_and_says_so(base_dir, data_file, tmp_path, monkeypatch):
    cfg = train_config(base_dir, data_file, tmp_path / "run", steps=6, save_every=2, **QUICK)
    real_save, saves = torch.save, []

    def save_until_disk_is_full(obj, target, *args, **kwargs):
        saves.append(target)
        if len(saves) == 1:
            return real_save(obj, target, *args, **kwargs)
        with open(target, "wb") as f:  # half a file, then the disk is full
            f.write(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", save_until_disk_is_full)
    with pytest.raises(UserError, match="No space left on device.*unchanged"):
        train(cfg, progress=False)
    monkeypatch.undo()

    run_dir = tmp_path / "run"
    assert len(saves) == 2 and _leftovers(run_dir) == []
    state = load_train_state(run_dir / STATE_DIR, cfg)  # the step-2 state, whole and loadable
    assert state["step"] == 2
    assert json.loads((run_dir / STATE_DIR / "state.json").read_text())["step"] == 2

    # and the run continues from it to the end
    assert train(replace(cfg, resume="auto"), progress=False) == run_dir / "checkpoint"
    assert json.loads((run_dir / STATE_DIR / "state.json").read_text())["step"] == 6


def test_resolved_config_is_saved_with_the_train_state_and_reloads(base_dir, data_file, tmp_path):
    cfg = train_config(base_dir, data_file, tmp_path / "run", steps=2, save_every=1, **QUICK)
    train(cfg, progress=False)
    assert load_train_config(tmp_path / "run" / STATE_DIR / "config.toml", []) == cfg

    changed = replace(cfg, lr=0.5, resume="auto")
    with pytest.raises(UserError, match=r"lr \(0.01 -> 0.5\)"):
        train(changed, progress=False)


def test_toml_round_trip_and_unknown_keys(tmp_path):
    cfg = TrainConfig(
        lr=1e-5,
        warmup_steps=2000,
        schedule="constant",
        data='jsonl:/a "quoted" path.jsonl',
        entropy_weight=float("inf"),
        curriculum=False,
    )
    path = tmp_path / "run.toml"
    path.write_text(to_toml(cfg))
    assert load_train_config(path, []) == cfg
    assert load_train_config(path, ["lr=3e-4"]).lr == 3e-4  # key=value wins over the file

    for text, error in [
        ("lr = 1e-5\nlearning_rate = 1e-5\n", "learning_rate"),
        ("[train]\nlr = 1e-5\n", "train must be plain settings"),
        ("steps = 'many'\n", "expected a int"),
        ("lr = \n", "cannot read config"),
    ]:
        path.write_text(text)
        with pytest.raises(UserError, match=error):
            load_train_config(path, [])


@pytest.mark.process
def test_cli_config_errors_are_one_clean_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("stepz = 3\n")
    done = subprocess.run(
        [sys.executable, "-m", "mtplm.cli", "train", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "unknown setting 'stepz=3'" in done.stderr


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "cannot read training data"),  # no such file
        ("{not json\n", "cannot read training data"),
        ('{"text": ""}\n{"prompt": "t1 t2", "response": ""}\n', "zero-length sequences"),
        ('{"prompt": "", "response": "t1 t2 t3"}\n', "row 1: the prompt is empty"),
        ('{"text": null}\n', "row 1"),
    ],
)
def test_bad_training_data_is_a_clear_error_and_writes_nothing(base_dir, tmp_path, content, message):
    data = tmp_path / "data.jsonl"
    if content is not None:
        data.write_text(content)
    cfg = train_config(base_dir, data, tmp_path / "run", steps=2, **QUICK)
    with pytest.raises(UserError, match=message):
        train(cfg, progress=False)
    assert not (tmp_path / "run").exists()


def test_resume_from_a_missing_state_is_a_clear_error(base_dir, data_file, tmp_path):
    cfg = train_config(
        base_dir, data_file, tmp_path / "run", steps=2, resume=str(tmp_path / "nowhere"), **QUICK
    )
    with pytest.raises(UserError, match="no state.pt there"):
        train(cfg, progress=False)


def test_resume_auto_without_a_state_starts_fresh(base_dir, tmp_path):
    data = write_rows(tmp_path / "d.jsonl", chain_rows(40, seed=3))
    cfg = train_config(base_dir, data, tmp_path / "run", steps=2, resume="auto", **QUICK)
    assert train(cfg, progress=False) == tmp_path / "run" / "checkpoint"


def test_checkpoint_whose_tokenizer_lost_the_mask_token_is_a_clear_error(tmp_path):
    model = tiny_mtp()
    model.save(tmp_path / "ckpt")
    tiny_tokenizer().save_pretrained(tmp_path / "ckpt")  # the base tokenizer, without <mtp>
    with pytest.raises(UserError, match="no <mtp> token"):
        MTPModel.load(tmp_path / "ckpt")


def test_prefix_loss_needs_a_recipe_that_trains_the_real_rows():
    for ignored in (TrainConfig(ntp_weight=0.1), TrainConfig(ntp_weight=0.1, method="heads")):
        with pytest.raises(
            UserError, match="ntp_weight trains the real rows: use method=mask with trainable=lora"
        ):
            # gated-lora (the default) and the heads' frozen trunk would silently ignore it
            ignored.validate()
    for fine in (
        TrainConfig(ntp_weight=0.1, trainable="lora"),
        TrainConfig(ntp_weight=0.1, trainable="full"),
        TrainConfig(ntp_weight=0.0),
    ):
        fine.validate()


def test_distributed_settings_are_checked():
    with pytest.raises(UserError, match="parallel=fsdp shards a full fine-tune"):
        TrainConfig(parallel="fsdp").validate()
    with pytest.raises(UserError, match="parallel must be ddp or fsdp"):
        TrainConfig(parallel="zero3").validate()
    with pytest.raises(UserError, match="device must be"):
        TrainConfig(device="tpu").validate()


def test_a_tied_lm_head_is_neither_saved_as_trainable_nor_refused_on_resume():
    """SmolLM2 ties its LM head to the embeddings: the frozen alias must not ride along in train_state (it
    once did, and the resume then refused the state as 'unknown lm_head.weight')."""
    from conftest import tiny_llama

    from mtplm.train.distributed import World, trainable_state
    from mtplm.train.trainer import Trainer

    def tied() -> MTPModel:
        model = MTPModel(tiny_llama(tied=True), tiny_tokenizer(), None)
        model.add_mask_token(k_max=4, base_identity={"name": "tiny-tied"})
        return model

    cfg = TrainConfig(trainable="gated-lora", lora_rank=4, lora_alpha=8.0)
    first = Trainer(cfg, tied())
    assert first.model.hf.lm_head.weight is first.model.hf.get_input_embeddings().weight
    with torch.no_grad():
        for name, p in first.model.hf.named_parameters():
            if ".lora_b" in name:
                p.normal_(0, 0.2)
    weights, _ = trainable_state(first.model.hf, first.optimizer, World())
    assert weights and all(".lora_" in name for name in weights)
    old_state = {**weights, "lm_head.weight": first.model.hf.lm_head.weight.detach().clone()}
    for saved in (weights, old_state):
        resumed = dict(Trainer(cfg, tied(), weights=saved).model.hf.named_parameters())
        for name, w in weights.items():
            torch.testing.assert_close(resumed[name].detach(), w)


def test_the_ground_truth_kv_is_kept_only_where_it_fits_the_budget_and_the_free_ram(monkeypatch, capsys):
    """Under gated LoRA the texts' base KV is cached once, but never past ground_truth_cache_gb nor past
    the share of free RAM the steps can spare (a 15 GB store beside 5 GB of training once ran out of 23 GB):
    past either, training recomputes it each step."""
    from types import SimpleNamespace

    from mtplm.train import recipes
    from mtplm.train.data import Sample

    samples = [Sample([1, 2], list(range(3, 20))) for _ in range(12)]

    def prepared(gb: float):
        recipe = recipes.GatedLoRA(TrainConfig(seq_len=32, ground_truth_cache_gb=gb))
        recipe.model = tiny_mtp(gated=True)
        recipe.prepare(samples, progress=False)
        return recipe.store

    assert prepared(1.0) is not None and len(prepared(1.0).states) == len(samples)
    assert prepared(1e-9) is None and "more than ground_truth_cache_gb" in capsys.readouterr().out
    monkeypatch.setattr(recipes.psutil, "virtual_memory", lambda: SimpleNamespace(available=1000))
    assert prepared(1.0) is None and "more than the RAM training can spare" in capsys.readouterr().out


def test_a_session_killed_outright_still_counts_up_to_its_last_log_line(tmp_path):
    """No exit handler runs under SIGKILL: the compute is on disk from the first logged step on."""
    from mtplm.train.checkpoint import ComputeClock, MetricsLog

    clock = ComputeClock(tmp_path)  # never exited, as in a killed process
    started = time.process_time()
    while time.process_time() - started < 0.2:
        pass
    MetricsLog(tmp_path, clock).record({"step": 1})
    killed = json.loads((tmp_path / "compute.json").read_text())
    assert killed["sessions"] == 1 and killed["cpu_s"] >= 0.15
    with ComputeClock(tmp_path) as resumed:  # the next session counts on from there
        assert resumed.totals()["sessions"] == 2 and resumed.totals()["cpu_s"] >= killed["cpu_s"]


def test_compute_adds_up_over_resumed_sessions_and_restarts_with_a_fresh_run(tmp_path):
    from mtplm.train.checkpoint import ComputeClock

    def session(fresh: bool = False) -> dict:
        with ComputeClock(tmp_path) as clock:
            if fresh:
                clock.fresh()
            started = time.process_time()
            while time.process_time() - started < 0.25:  # some CPU time
                pass
        return json.loads((tmp_path / "compute.json").read_text())

    first = session()
    second = session()  # a resumed session counts on
    assert (first["sessions"], second["sessions"]) == (1, 2)
    assert second["cpu_s"] > first["cpu_s"] > 0 and second["wall_s"] > first["wall_s"]
    assert session(fresh=True)["sessions"] == 1  # a run started over does not inherit the old compute
    with ComputeClock(tmp_path / "never-made"):
        pass
    assert not (tmp_path / "never-made").exists()  # a run refused before it began leaves nothing behind
