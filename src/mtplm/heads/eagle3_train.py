"""Training an EAGLE-3 drafter on a frozen target (`mtplm train method=heads head_form=eagle3`).

Like the other head forms it learns from cached target states (heads.trunk.trunk_states), here with the
inputs of the three feature layers cached beside the final states, and it trains on whole rows (its
attention reads every earlier row). The draft vocabulary is fixed first: the `draft_vocab` target tokens that
the training labels use most (heads.eagle3.draft_vocabulary).

Per step (`Eagle3Trainer.step`), with K = k_max (K-1 drafting steps, as heads 2..K):
  outs = drafter.unroll(features, text, K-1)   training-time test: step j reads step j-1's own output
  loss = sum_j alpha_{j+2} * CE_j              head_alpha's weights; step j predicts token t+2+j
where CE_j is over response rows whose label (the target's greedy token: 'hard'; the text: 'ground-truth')
lies in the draft vocabulary, or a KL to the target's distribution over the draft vocabulary ('soft').
Each step's logits [rows, N] are recomputed in the backward pass (checkpointed), so one step's logits are
alive at a time. The curriculum, per-head learning rates and consistency loss belong to the block forms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from mtplm.config import TrainConfig
from mtplm.errors import UserError
from mtplm.heads.eagle3 import Eagle3Drafter, draft_vocabulary, for_target, resolve_layers
from mtplm.heads.forms import head_weights
from mtplm.heads.train import train_heads
from mtplm.heads.trunk import HeadBatch, TrunkRow
from mtplm.model import MTPModel
from mtplm.registry import HEAD_TRAINERS


class Eagle3Trainer:
    def __init__(self, cfg: TrainConfig, model: MTPModel, drafter: Eagle3Drafter) -> None:
        self.cfg, self.drafter = cfg, drafter
        self.embed_weight = model.hf.get_input_embeddings().weight.detach().float()  # frozen, shared
        self.lm = model.hf.get_output_embeddings().weight.detach().float()  # the target's head: soft labels
        self.index = torch.full((len(drafter.t2d),), -1, dtype=torch.long)  # target id -> draft id, -1: none
        self.index[drafter.draft_ids] = torch.arange(len(drafter.d2t))
        trainable = [p for p in drafter.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_weight)

    def unroll(self, batch: HeadBatch) -> list[torch.Tensor]:
        assert batch.features is not None, "EAGLE-3 trains on cached feature layers"
        return self.drafter.unroll(
            batch.features, batch.tokens, batch.lengths, self.drafter.k - 1, self._embed
        )

    def step(self, batch: HeadBatch, step: int) -> dict:
        cfg = self.cfg
        for group in self.opt.param_groups:
            group["lr"] = cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup_steps))
        weights = head_weights(self.drafter.k, cfg.head_alpha, step / max(1, cfg.steps))
        total, losses = torch.zeros(()), []
        for j, out in enumerate(self.unroll(batch)):
            term = checkpoint(
                self._loss, out, batch, j + 2, use_reentrant=False
            )  # logits rebuilt in backward
            total = total + weights[j] * term
            losses.append(round(float(term.detach()), 4))
        self.opt.zero_grad(set_to_none=True)
        total.backward()
        self.opt.step()
        return {"loss": float(total.detach()), "step_losses": losses}

    def _loss(self, out: torch.Tensor, batch: HeadBatch, k: int) -> torch.Tensor:
        """Mean loss of drafting step k-2 (token t+k) over its supervised rows; zero if it has none."""
        valid = batch.valid(k)
        if self.cfg.objective == "soft":
            logits = self.drafter.logits(out[valid])  # [M, N]
            with (
                torch.no_grad()
            ):  # the target's distribution over token t+k (read at row t+k-1), draft tokens only
                source = torch.cat([batch.hidden[:, k - 1 :], batch.hidden[:, -1:].expand(-1, k - 1, -1)], 1)
                teacher = F.log_softmax(source[valid] @ self.lm[self.drafter.draft_ids].T, -1)
            per_row = F.kl_div(F.log_softmax(logits, -1), teacher, log_target=True, reduction="none").sum(-1)
            return per_row.mean() if len(per_row) else out.sum() * 0.0
        target = self.index[
            batch.targets(k, self.cfg.objective)
        ]  # [B, T] draft ids, -1 outside the vocabulary
        chosen = valid & (target >= 0)
        if not bool(chosen.any()):
            return out.sum() * 0.0
        return F.cross_entropy(self.drafter.logits(out[chosen]), target[chosen])

    @torch.no_grad()
    def validate(self, batches: list[HeadBatch]) -> dict:
        """Per-depth top-1 agreement with the target's greedy token (depth k = drafting step k-2, chained on
        its own states), and the verified-decoding estimate: 1 + the leading run of right depths, per row."""
        k_max = self.drafter.k
        right: list[list[torch.Tensor]] = [[] for _ in range(k_max + 1)]
        runs = []
        for batch in batches:
            rows, correct = batch.valid(k_max), []
            for k, out in enumerate(self.unroll(batch), start=2):
                drafted = self.drafter.draft_ids[self.drafter.logits(out).argmax(-1)]  # [B, T] target ids
                hit = drafted == batch.targets(k, "hard")
                right[k].append(hit[batch.valid(k)].float())
                correct.append(hit[rows])
            if correct:
                runs.append(1.0 + torch.stack(correct, -1).int().cumprod(-1).sum(-1).float())
        agreement = [1.0] + [
            float(torch.cat(r).mean()) if r and torch.cat(r).numel() else 0.0 for r in right[2:]
        ]
        est = float(torch.cat(runs).mean()) if runs and torch.cat(runs).numel() else 1.0
        return {"agreement": agreement, "est_verified_per_forward": est, "est_tokens_per_forward": est}


class Eagle3Training:
    """heads.train.train_heads' hooks for EAGLE-3: cache the feature layers, whole rows, the draft
    vocabulary."""

    windows = False

    @staticmethod
    def layers(cfg: TrainConfig, model: MTPModel) -> tuple[int, ...]:
        return tuple(resolve_layers(cfg.eagle3_layers, model.hf.config.num_hidden_layers))

    @staticmethod
    def setup(cfg: TrainConfig, model: MTPModel, rows: list[TrunkRow]):
        if cfg.consistency_weight:
            raise UserError(
                "consistency_weight applies to the block head forms (medusa, sequential), not eagle3"
            )
        vocab = model.hf.get_input_embeddings().weight.shape[0]
        counts = torch.zeros(vocab, dtype=torch.long)
        for row in rows:  # the labels the drafter learns: the target's greedy tokens (or the text's)
            labels = (
                row.tokens[row.start + 2 :]
                if cfg.objective == "ground-truth"
                else row.greedy[row.start + 1 : -1]
            )
            counts += torch.bincount(labels, minlength=vocab)[:vocab]
        layers = list(Eagle3Training.layers(cfg, model))
        drafter = for_target(
            model.hf, cfg.k_max, layers, draft_vocabulary(counts, min(cfg.draft_vocab, vocab))
        )
        return drafter, Eagle3Trainer(cfg, model, drafter)


@HEAD_TRAINERS.register("eagle3", "the shared head-training loop with EAGLE-3's hooks")
def train_eagle3(cfg: TrainConfig, progress: bool = True):
    """`mtplm train method=heads head_form=eagle3`: the shared head-training loop with EAGLE-3's hooks."""
    return train_heads(cfg, progress, form=Eagle3Training)
