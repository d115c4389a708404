"""Training head-based MTP on a frozen trunk (`mtplm train method=heads`).

The trunk never changes, so its final hidden states for the training text are computed once
(`trunk_states`, heads/trunk.py) and every step trains only the heads on them: the cost per step is the
heads and the LM-head softmaxes, not the model. Drafting stays lossless because the trunk and LM head are
the base model's.

Per step (`HeadTrainer.step`):
  loss = sum_k alpha_k * CE_k  (+ lambda * consistency), heads k = 2..K, with
  - targets from self-distillation: the base model's own greedy token ('hard'), its distribution
    ('soft', KL), or the text ('ground-truth');
  - the dynamic-masking curriculum: per sample a start s in [1, s_hi]; only heads k >= s are
    supervised (earlier positions are given: the chain reads ground truth). s_hi falls from K to 1
    over the first `curriculum_fraction` of training, so by then every head learns on every sample;
  - per-head learning rates (heads.head_lr_scale);
  - consistency MSE(E_t[head_k], E_{t+1}[head_{k-1}]) between expected token embeddings (both heads
    predict the same absolute token), divided by the embeddings' mean square so that lambda does not
    depend on the model's embedding scale; the gradient reaches head k, the nearer head's side is detached;
  - one head's logits alive at a time: each head's loss is differentiated to its own hidden states
    (d-dimensional) and freed before the next head; one backward through the heads then follows.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from mtplm.config import TrainConfig, as_dict
from mtplm.files import home
from mtplm.heads.forms import Heads, head_lr_scale, head_weights
from mtplm.heads.resume import Loop, restore, save, saved_state
from mtplm.heads.trunk import HeadBatch, TrunkRow, trunk_states
from mtplm.model import MTPModel
from mtplm.registry import HEAD_TRAINERS
from mtplm.train.checkpoint import ComputeClock, MetricsLog

# TrunkRow, HeadBatch and trunk_states live in heads/trunk.py; re-exported: the tests import them from here
__all__ = ["BlockTraining", "HeadBatch", "HeadTrainer", "TrunkRow", "train_heads", "trunk_states"]


class HeadTrainer:
    def __init__(self, cfg: TrainConfig, model: MTPModel, heads: Heads) -> None:
        self.cfg, self.heads = cfg, heads
        self.lm = model.hf.get_output_embeddings().weight.detach().float()  # [V, D] frozen, shared
        self.lm_low = self.lm.bfloat16() if cfg.far_heads_bf16 else self.lm
        self.embed = model.hf.get_input_embeddings()
        self.embed_weight = self.embed.weight.detach().float()
        self.embed_scale = float(self.embed_weight.pow(2).mean())  # consistency MSE is relative to this
        groups = [
            {"params": list(block.parameters()), "lr": cfg.lr * self._lr_scale(k), "head": k}
            for k, block in enumerate(heads.blocks, start=2)
        ]
        self.opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.generator = torch.Generator().manual_seed(cfg.seed)

    def _lr_scale(self, k: int) -> float:
        return head_lr_scale(k) if self.cfg.head_lr == "distance" else 1.0

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_weight)

    def logits(self, k: int, x: torch.Tensor) -> torch.Tensor:
        """Head k's logits [N, V] in float32; heads 5+ multiply in bfloat16 when far_heads_bf16."""
        if k >= 5 and self.cfg.far_heads_bf16:
            return (x.bfloat16() @ self.lm_low.T).float()
        return x @ self.lm.T

    def supervised(self, batch: HeadBatch, progress: float) -> torch.Tensor:
        """[B]: the curriculum's start s per sample (1 = every head), drawn from [1, s_hi]."""
        k = self.heads.k
        if not self.cfg.curriculum:
            return torch.ones(len(batch.lengths), dtype=torch.long)
        s_hi = round(k - (k - 1) * min(1.0, progress / self.cfg.curriculum_fraction))
        return torch.randint(
            1, max(1, s_hi) + 1, (len(batch.lengths),), generator=self.generator, device=self.generator.device
        )

    def step(self, batch: HeadBatch, step: int) -> dict:
        cfg, k_max = self.cfg, self.heads.k
        progress = step / max(1, cfg.steps)
        for group in self.opt.param_groups:
            group["lr"] = (
                cfg.lr * self._lr_scale(group["head"]) * min(1.0, (step + 1) / max(1, cfg.warmup_steps))
            )
        start = self.supervised(batch, progress)
        weights = head_weights(k_max, cfg.head_alpha, progress)
        states = self.heads.states(batch.hidden, batch.tokens, self._embed)
        grads: list[torch.Tensor] = []
        stats: dict[str, Any] = {"loss": 0.0, "agreement": [1.0], "consistency": 0.0, "supervised": []}
        previous = self._expected(self.logits(1, batch.hidden)).detach() if cfg.consistency_weight else None
        for k, x in enumerate(states, start=2):
            valid = batch.valid(k)
            train_rows = valid & (start[:, None] <= k)
            logits = self.logits(k, x[valid])  # only this head's logits are alive
            target = batch.targets(k, cfg.objective)[valid]
            chosen = train_rows[valid]
            per_row = self._loss(logits, target, batch, k, valid)
            loss = weights[k - 2] * (per_row * chosen).sum() / max(1, int(chosen.sum()))
            expected = None
            if cfg.consistency_weight:
                expected = torch.zeros_like(x)
                expected[valid] = self._expected(logits)
                assert previous is not None  # set above whenever consistency_weight is
                nearer = torch.cat([previous[:, 1:], previous[:, -1:]], 1)  # E_{t+1}[head k-1]
                gap = (expected - nearer).pow(2).mean(-1) / self.embed_scale
                cons = (gap * train_rows).sum() / max(1, int(train_rows.sum()))
                loss = loss + cfg.consistency_weight * cons
                stats["consistency"] += float(cons.detach())
                previous = expected.detach()
            grads.append(torch.autograd.grad(loss, x)[0])
            stats["loss"] += float(loss.detach())
            stats["agreement"].append(
                float((logits.argmax(-1) == target).float().mean()) if len(target) else 0.0
            )
            stats["supervised"].append(int(chosen.sum()))
            del logits, per_row, expected
        self.opt.zero_grad(set_to_none=True)
        torch.autograd.backward(states, grads)
        self.opt.step()
        return stats

    def _loss(
        self, logits: torch.Tensor, target: torch.Tensor, batch: HeadBatch, k: int, valid: torch.Tensor
    ) -> torch.Tensor:
        if self.cfg.objective != "soft":
            return F.cross_entropy(logits, target, reduction="none")
        with torch.no_grad():  # the trunk's distribution over token t+k, read at row t+k-1
            source = torch.cat([batch.hidden[:, k - 1 :], batch.hidden[:, -1:].expand(-1, k - 1, -1)], 1)
            teacher = F.log_softmax(source[valid] @ self.lm.T, -1)
        return F.kl_div(F.log_softmax(logits, -1), teacher, log_target=True, reduction="none").sum(-1)

    def _expected(self, logits: torch.Tensor) -> torch.Tensor:
        """The expected token embedding under a head's distribution: softmax(logits) @ E."""
        return F.softmax(logits, -1) @ self.embed_weight

    @torch.no_grad()
    def validate(self, batches: list[HeadBatch]) -> dict:
        """Per-head top-1 agreement with the trunk's greedy token, and the verified-decoding estimate:
        1 + the leading run of heads 2..K that are right, per row (a linear-window pass's yield)."""
        k_max = self.heads.k
        right: list[list[torch.Tensor]] = [[] for _ in range(k_max + 1)]
        runs, gaps = [], []
        for batch in batches:
            states = self.heads.states(batch.hidden, batch.tokens, self._embed)
            rows = batch.valid(k_max)
            correct, previous = [], self._expected(self.logits(1, batch.hidden))
            for k, x in enumerate(states, start=2):
                logits = self.logits(k, x)
                hit = logits.argmax(-1) == batch.targets(k, "hard")
                right[k].append(hit[batch.valid(k)].float())
                correct.append(hit[rows])
                expected = self._expected(logits)
                gap = (expected[:, :-1] - previous[:, 1:]).pow(2).mean(-1) / self.embed_scale
                gaps.append(gap[batch.valid(k)[:, :-1]])
                previous = expected
            if correct:
                run = torch.stack(correct, -1).int().cumprod(-1).sum(-1)
                runs.append(1.0 + run.float())
        agreement = [1.0] + [
            float(torch.cat(r).mean()) if r and torch.cat(r).numel() else 0.0 for r in right[2:]
        ]
        est = float(torch.cat(runs).mean()) if runs else 1.0
        consistency = float(torch.cat(gaps).mean()) if gaps else 0.0
        return {
            "agreement": agreement,
            "est_verified_per_forward": est,
            "est_tokens_per_forward": est,
            "consistency_mse": consistency,
        }


class BlockTraining:
    """What train_heads needs of a head form: the feature layers to cache, its module and trainer, and whether
    a step may read windows of rows (heads that read one row each) or needs whole rows (attention)."""

    windows = True

    @staticmethod
    def layers(cfg: TrainConfig, model: MTPModel) -> tuple[int, ...]:
        return ()  # the final state only

    @staticmethod
    def setup(cfg: TrainConfig, model: MTPModel, rows: list[TrunkRow]):
        dim = model.hf.get_input_embeddings().weight.shape[1]
        heads = Heads(cfg.head_form, cfg.k_max, dim, getattr(model.hf.config, "intermediate_size", None))
        return heads, HeadTrainer(cfg, model, heads)


def train_heads(cfg: TrainConfig, progress: bool = True, form=BlockTraining) -> Path:
    """`mtplm train method=heads`: trunk states once, then `steps` head updates; saves run_dir/checkpoint."""
    with ComputeClock(Path(cfg.out)) as clock:
        return _train_heads(cfg, progress, form, clock)


def _train_heads(cfg: TrainConfig, progress: bool, form, clock: ComputeClock) -> Path:
    import resource

    from mtplm.assets.models import model_identity, resolve_model
    from mtplm.plots import training_curves
    from mtplm.train.data import load_samples

    torch.manual_seed(cfg.seed)
    run_dir = Path(cfg.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(as_dict(cfg), indent=2) + "\n")
    model = MTPModel.load(cfg.model, dtype=cfg.dtype)
    samples = load_samples(cfg.data, model.tokenizer, model.hf, run_dir, cfg)
    rows = trunk_states(model, samples, cfg.seq_len, progress, home() / "trunk", form.layers(cfg, model))
    num_val = max(1, int(len(rows) * cfg.val_fraction))
    train_rows, val_rows = (rows[:-num_val] or rows), rows[-num_val:]
    val_batches = [
        HeadBatch.of(val_rows[i : i + cfg.batch_size]) for i in range(0, len(val_rows), cfg.batch_size)
    ]
    heads, trainer = form.setup(cfg, model, train_rows)
    state = saved_state(cfg)  # before the log opens: resuming first cuts the metrics after the saved step
    if state is None:
        clock.fresh()
    log = MetricsLog(run_dir, clock)
    val = _fit(
        cfg,
        trainer,
        train_rows,
        val_batches,
        log.record,
        cfg.head_window if form.windows else 0,
        progress,
        state,
    )
    log.close()
    model.attach_heads(heads, model_identity(resolve_model(cfg.model)), spec=cfg.model)
    assert model.meta is not None  # attach_heads sets it
    model.meta.training = {
        "config": as_dict(cfg),
        "steps": cfg.steps,
        "samples": len(samples),
        "compute": clock.totals(),
        "final_val": val,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }
    out = model.save_heads(run_dir / "checkpoint")
    training_curves(run_dir)
    return out


def _fit(
    cfg: TrainConfig,
    trainer,
    train_rows: list[TrunkRow],
    val_batches: list[HeadBatch],
    record,
    window: int,
    progress: bool,
    state: dict | None = None,
) -> dict:
    """`cfg.steps` updates over shuffled batches (windows of `window` rows, 0 = whole rows); the last
    validation. Saves out/train_state every `save_every` steps and when a SIGTERM / SIGINT stops it; `state`
    continues one."""
    from mtplm.train import checkpoint

    loop = Loop(list(range(len(train_rows))), len(train_rows), random.Random(cfg.seed))
    if state is not None:
        start, val = restore(state, trainer, loop)
    else:
        start, val = 0, trainer.validate(val_batches)
        record({"step": 0, "val": val})
    bar = tqdm(
        range(start, cfg.steps),
        desc="train heads",
        unit="step",
        disable=not progress,
        initial=start,
        total=cfg.steps,
    )
    with checkpoint.stop_requests(True) as stop:
        for step in bar:
            batch = HeadBatch.of(
                [train_rows[i].window(window, cfg.k_max, loop.rng) for i in loop.next(cfg.batch_size)]
            )
            stats = trainer.step(batch, step)
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                record({"step": step + 1, **stats})
            bar.set_postfix(loss=f"{stats['loss']:.3f}", val_tpf=f"{val['est_verified_per_forward']:.2f}")
            if (step + 1) % cfg.val_every == 0 or step == cfg.steps - 1:
                val = trainer.validate(val_batches)
                record({"step": step + 1, "val": val})
                tqdm.write(
                    f"[step {step + 1}] held-out head agreement "
                    + " ".join(f"h{k}={a:.2f}" for k, a in enumerate(val["agreement"][1:], start=2))
                    + f"; verified tokens/forward (est.) {val['est_verified_per_forward']:.2f}"
                )
            if stop.signal is not None or ((step + 1) % cfg.save_every == 0 and step != cfg.steps - 1):
                save(cfg, trainer, loop, step + 1, val)
            if stop.signal is not None:
                tqdm.write(
                    f"stopped by signal {stop.signal} after step {step + 1}; its train_state is saved: "
                    "continue with resume=auto"
                )
                raise KeyboardInterrupt
    return val


for _form in ("medusa", "sequential"):
    HEAD_TRAINERS.register(_form, "heads on the cached trunk states, one block per future token")(train_heads)
