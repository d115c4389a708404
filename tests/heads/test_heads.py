"""Head-based MTP: heads learn their offsets, the training devices act as they should, verified
decoding with heads is the base model's greedy output, one head's logits live at a time, Medusa export."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama, tiny_tokenizer, with_random_heads

from mtplm.config import DecodeConfig, TrainConfig
from mtplm.decode.run.loop import generate
from mtplm.heads.forms import Heads
from mtplm.heads.train import HeadBatch, HeadTrainer, TrunkRow, trunk_states
from mtplm.model import MTPModel, load_model
from mtplm.text import chat_prompt_ids


@pytest.fixture(scope="session", params=["medusa", "sequential"])
def heads_checkpoint(request, base_dir, data_file, tmp_path_factory) -> Path:
    """Heads 2..4 trained 150 steps on the chain language's frozen tiny base."""
    from synthetic import train_config

    from mtplm.train.trainer import train

    run = tmp_path_factory.mktemp(f"heads-{request.param}") / "run"
    cfg = train_config(
        base_dir, data_file, run, method="heads", head_form=request.param, steps=150, lr=3e-3, val_every=150
    )
    return train(cfg, progress=False)


def _final_val(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "mtplm.json").read_text())["training"]["final_val"]


def test_each_head_learns_its_own_offset(heads_checkpoint, base_dir, data_file):
    """Head k predicts token t+k: on held-out chain text it matches t+k, not its neighbours."""
    from synthetic import chain_rows

    model = load_model(str(heads_checkpoint))
    base = MTPModel.load(str(base_dir))
    assert all(a > 0.9 for a in _final_val(heads_checkpoint)["agreement"][1:])
    tok = model.tokenizer
    rows = chain_rows(20, seed=99)
    hits = {k: {-1: 0, 0: 0, 1: 0} for k in (2, 3, 4)}
    total = 0
    with torch.inference_mode():
        for row in rows:
            ids = tok(row["prompt"] + " " + row["response"])["input_ids"]
            hidden = base.decoder_states(torch.tensor([ids]))[0]
            for t in range(1, len(ids) - 5):
                drafts = model.draft_block(hidden[t], ids[t + 1], 3).argmax(-1).tolist()
                total += 1
                for k, d in zip((2, 3, 4), drafts, strict=False):
                    for shift in (-1, 0, 1):
                        hits[k][shift] += d == ids[t + k + shift]
    for k in (2, 3, 4):
        assert hits[k][0] / total > 0.9, (k, hits[k])
        assert hits[k][-1] / total < 0.2 and hits[k][1] / total < 0.2, (k, hits[k])


def test_verified_decoding_with_heads_is_plain_greedy(heads_checkpoint):
    from synthetic import chain_rows

    model = load_model(str(heads_checkpoint))
    prompts = [chat_prompt_ids(model.tokenizer, r["prompt"]) for r in chain_rows(12, seed=5)]
    prompts += [
        model.tokenizer(" ".join(f"t{(7 * i + 3) % 60}" for i in range(n)))["input_ids"] for n in (3, 9)
    ]
    forwards = tokens = 0
    tree_forwards = {"2,2": 0, "3,1,2": 0}
    for ids in prompts:
        plain = generate(model, ids, DecodeConfig(mode="ntp", max_new_tokens=24)).tokens
        for window in ("fixed", "adaptive"):
            out = generate(model, ids, DecodeConfig(mode="verified", window=window, max_new_tokens=24))
            assert out.tokens == plain, (ids, window)
        forwards, tokens = forwards + out.forwards, tokens + len(out.tokens)
        for widths in ("2,2", "3,1,2"):
            tree = generate(
                model,
                ids,
                DecodeConfig(mode="verified", drafting="tree", tree_widths=widths, max_new_tokens=24),
            )
            assert tree.tokens == plain, (ids, widths)
            tree_forwards[widths] += tree.forwards
    assert tokens / forwards > 2.0  # trained heads: most drafts survive
    assert all(n <= forwards for n in tree_forwards.values())  # a tree holds the chain of top choices too


def test_untrained_heads_stay_lossless_and_lossy_modes_run(base_dir):
    """Random (untrained, perturbed) heads draft mostly wrong tokens: verified output is still plain
    greedy."""
    model = with_random_heads(base_dir, "sequential")
    ids = model.tokenizer("t1 t2 t3")["input_ids"]
    plain = generate(model, ids, DecodeConfig(mode="ntp", max_new_tokens=20)).tokens
    assert generate(model, ids, DecodeConfig(mode="verified", max_new_tokens=20)).tokens == plain
    tree = generate(
        model, ids, DecodeConfig(mode="verified", drafting="tree", tree_widths="3,2", max_new_tokens=20)
    )
    assert tree.tokens == plain
    static = generate(model, ids, DecodeConfig(mode="static", k=3, max_new_tokens=20))
    assert static.forwards < len(static.tokens) and len(static.tokens) == 20
    conf = generate(model, ids, DecodeConfig(mode="confadapt", tau=1.0, max_new_tokens=20))
    assert conf.tokens == plain  # tau 1 never trusts a head: plain decoding


# ---- the training devices, on a tiny model and hand-built trunk states ----
def _trainer(k: int = 4, vocab: int = 64, **settings) -> tuple[HeadTrainer, MTPModel]:
    hf = tiny_llama(seed=0, vocab=vocab, hidden=32)
    model = MTPModel(hf, tiny_tokenizer(vocab), None)
    cfg = TrainConfig(
        method="heads", k_max=k, lr=1e-2, warmup_steps=1, steps=100, far_heads_bf16=False, **settings
    ).validate()
    return HeadTrainer(cfg, model, Heads("medusa", k, 32)), model


def _batch(rows: int = 6, length: int = 24, vocab: int = 64, seed: int = 0) -> HeadBatch:
    g = torch.Generator().manual_seed(seed)
    return HeadBatch.of(
        [
            TrunkRow(
                torch.randn(length, 32, generator=g),
                torch.randint(0, vocab, (length,), generator=g),
                torch.randint(0, vocab, (length,), generator=g),
                2,
            )
            for _ in range(rows)
        ]
    )


def _head_grads(trainer: HeadTrainer, batch: HeadBatch) -> list[float]:
    for group in trainer.opt.param_groups:
        group["lr"] = 0.0
    trainer.cfg = TrainConfig(**{**trainer.cfg.__dict__, "lr": 0.0})
    trainer.step(batch, 50)
    return [float(block.linear.bias.grad.norm()) for block in trainer.heads.blocks]


def test_alpha_weights_scale_each_heads_gradient():
    batch = _batch()
    flat = _head_grads(_trainer(head_alpha="1", curriculum=False)[0], batch)
    decay = _head_grads(_trainer(head_alpha="decay", curriculum=False)[0], batch)
    for k, (f, d) in enumerate(zip(flat, decay, strict=False), start=2):
        assert d / f == pytest.approx(0.9**k, rel=1e-4)


def test_per_head_learning_rates_move_far_heads_less():
    trainer, _ = _trainer(k=8, curriculum=False)
    trainer.step(_batch(), 0)  # Adam's first step moves every parameter by about its lr
    moved = [
        float(block.linear.bias.detach().abs().max()) for block in trainer.heads.blocks
    ]  # from zero init
    near = moved[0]
    assert moved[1] == pytest.approx(near, rel=0.02)  # head 3: x1
    assert moved[3] == pytest.approx(0.8 * near, rel=0.02)  # head 5: x0.8
    assert moved[6] == pytest.approx(0.5 * near, rel=0.02)  # head 8: x0.5
    flat, _ = _trainer(k=8, curriculum=False, head_lr="flat")
    flat.step(_batch(), 0)
    assert float(flat.heads.blocks[6].linear.bias.detach().abs().max()) == pytest.approx(near, rel=0.02)


def test_curriculum_supervises_far_heads_first_then_every_head():
    trainer, _ = _trainer(k=6, curriculum=True, curriculum_fraction=0.5)
    batch = _batch(rows=64)
    valid = [int(batch.valid(k).sum()) for k in range(2, 7)]
    early = trainer.step(batch, 0)["supervised"]
    assert early[0] < early[-1] / valid[-1] * valid[0]  # a near head is skipped on more samples
    assert all(e < v for e, v in zip(early[:-1], valid[:-1], strict=False)) and early[-1] == valid[-1]
    assert trainer.step(batch, 60)["supervised"] == valid  # past the curriculum: every head, every sample
    assert _trainer(k=6, curriculum=False)[0].step(batch, 0)["supervised"] == valid


def test_consistency_loss_pulls_adjacent_heads_together(base_dir, data_file):
    """On the chain language: with lambda > 0 the first updates bring head k's expected embedding at t
    closer to head k-1's at t+1 than the cross-entropy alone does (later, accurate heads agree anyway)."""
    from mtplm.train.data import load_samples

    base = MTPModel.load(str(base_dir))
    cfg = TrainConfig(data=f"jsonl:{data_file}")
    batch = HeadBatch.of(
        trunk_states(base, load_samples(cfg.data, base.tokenizer, base.hf, Path("."), cfg)[:16], 32, False)
    )
    gaps = {}
    for weight in (0.0, 10.0):
        torch.manual_seed(0)
        trainer = HeadTrainer(
            TrainConfig(
                method="heads",
                k_max=4,
                lr=3e-3,
                warmup_steps=1,
                steps=40,
                curriculum=False,
                consistency_weight=weight,
            ),
            base,
            Heads("sequential", 4, base.hf.config.hidden_size, 64),
        )
        for step in range(3):
            trainer.step(batch, step)
        gaps[weight] = trainer.validate([batch])["consistency_mse"]
    assert gaps[10.0] < 0.92 * gaps[0.0], gaps


PEAK = """
import resource, sys, torch
sys.path[:0] = [{here!r}, {tests!r}]  # this file's folder, and tests/ (conftest)
from test_heads import _trainer, _batch
torch.set_num_threads(1)
trainer, _ = _trainer(k={k}, vocab=20000, curriculum=False)
batch = _batch(rows=8, length=128, vocab=20000)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
trainer.step(batch, 0)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.process
def test_per_head_backward_keeps_one_heads_logits_alive():
    """Peak memory of a step grows by far less than one head's logits when heads are added."""
    peaks = {}
    for k in (2, 8):
        here = Path(__file__).parent
        script = PEAK.format(here=str(here), tests=str(here.parent), k=k)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
        peaks[k] = int(out.stdout.split()[-1])
    one_head = 8 * 128 * 20000 * 4  # fp32 logits of one head: 82 MB
    assert peaks[8] - peaks[2] < 0.5 * one_head, peaks  # all at once would add 6 heads' logits and gradients


def test_medusa_export_round_trip(heads_checkpoint, tmp_path):
    from mtplm.errors import UserError
    from mtplm.heads.export import export_medusa, load_medusa

    model = load_model(str(heads_checkpoint))
    if model.heads.form != "medusa":
        with pytest.raises(UserError, match="no medusa-form heads"):
            export_medusa(str(heads_checkpoint), tmp_path / "medusa")
        return
    out = export_medusa(str(heads_checkpoint), tmp_path / "medusa")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["num_heads"] == 3 and config["original_lm_head"]
    heads, lm = load_medusa(out)
    assert torch.equal(lm, model.hf.get_output_embeddings().weight.float())
    h = torch.randn(5, model.hf.config.hidden_size)
    for ours, theirs in zip(model.heads.blocks, heads.blocks, strict=False):
        assert torch.equal(ours(h), theirs(h))


def test_heads_trunk_states_match_the_base(base_dir):
    """The cached trunk states are the base model's own final hidden states and greedy choices."""
    from mtplm.train.data import Sample

    base = MTPModel.load(str(base_dir))
    rows = trunk_states(base, [Sample([1, 2], [3, 4, 5, 6])], seq_len=32, progress=False)
    logits = base.logits(torch.tensor([[1, 2, 3, 4, 5, 6]]))[0]
    assert torch.equal(rows[0].greedy, logits.argmax(-1)) and rows[0].start == 1


def test_tree_drafting_errors_are_clear(mtp):
    from mtplm.errors import UserError

    with pytest.raises(UserError, match="greedy decoding only"):
        DecodeConfig(mode="verified", drafting="tree", temperature=0.7).validate()
    with pytest.raises(UserError, match="tree_widths"):
        DecodeConfig(mode="verified", drafting="tree", tree_widths="2,x").validate()


def test_soft_objective_is_the_kl_to_the_trunks_own_distribution():
    """Zero-initialised medusa heads predict LM(h_t); the soft target for head k is LM(h_{t+k-1}).
    Where every row's hidden state is the same, the two agree and the loss is exactly zero."""
    trainer, _ = _trainer(curriculum=False, objective="soft")
    same = _batch(rows=2)
    flat = HeadBatch(
        same.hidden[:, :1].expand_as(same.hidden).clone(), same.tokens, same.greedy, same.rows, same.lengths
    )
    assert trainer.step(flat, 0)["loss"] == pytest.approx(0.0, abs=1e-6)
    assert _trainer(curriculum=False, objective="soft")[0].step(same, 0)["loss"] > 0.01
