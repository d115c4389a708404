"""Head-based MTP: K-1 small heads on the trunk's final hidden state; head 1 is the LM head.

Head k (2..K) predicts token t+k from the hidden state at t, through the model's own (shared, frozen)
LM head. Two forms:

  medusa      z_k = h + SiLU(W_k h + b_k), W_k and b_k zero-initialised so every head starts as the
              LM head (Medusa-1's residual block; exports to vLLM's Medusa layout, see export.py).
  sequential  DeepSeek-V3's chain: depth d = k-1 projects [RMSNorm(x_{d-1}); RMSNorm(emb(t_{+d}))] and
              runs one pre-norm transformer block; x_0 = h. Each depth sees the token the previous
              depth predicts, so drafts are conditioned on each other. The block attends to its own
              position only (the trunk state already carries the context), so drafting needs no
              per-depth KV cache: a chain of K-1 one-row blocks.

Shapes: B batch, T tokens, D hidden, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from mtplm.registry import HEAD_FORMS


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class ResidualBlock(nn.Module):
    """h + SiLU(W h + b): zero-initialised, so it starts as the identity."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + nn.functional.silu(self.linear(h))


class Depth(nn.Module):
    """One DeepSeek-style module: projection of [norm(x); norm(emb)] -> one transformer block (identity at
    init)."""

    def __init__(self, dim: int, intermediate: int) -> None:
        super().__init__()
        self.norm_h, self.norm_e = RMSNorm(dim), RMSNorm(dim)
        self.proj = nn.Linear(2 * dim, dim, bias=False)
        with torch.no_grad():  # start by passing the normalised hidden state through
            self.proj.weight.zero_()
            self.proj.weight[:, :dim] = torch.eye(dim)
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.value, self.out = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.gate, self.up = (
            nn.Linear(dim, intermediate, bias=False),
            nn.Linear(dim, intermediate, bias=False),
        )
        self.down = nn.Linear(intermediate, dim, bias=False)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.down.weight)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        y = self.proj(torch.cat([self.norm_h(x), self.norm_e(emb)], -1))
        y = y + self.out(self.value(self.attn_norm(y)))  # attention over one position: softmax weight 1
        z = self.mlp_norm(y)
        return y + self.down(nn.functional.silu(self.gate(z)) * self.up(z))


class BlockForm:
    """A form made of K-1 blocks on the trunk's final state (`Heads`), trained by heads.train.

    Every HEAD_FORMS entry builds its module from a checkpoint's recorded config (`build`); its trainer is
    registered under the same name in HEAD_TRAINERS, beside the training code. The two block forms share the
    builder and differ in their blocks, training states and drafting.
    """

    @staticmethod
    def build(config: dict) -> nn.Module:
        return Heads(**config)


class Medusa(BlockForm):
    """Parallel heads: each block reads the trunk state; one LM-head call drafts them all."""

    @staticmethod
    def block(dim: int, intermediate: int) -> nn.Module:
        return ResidualBlock(dim)

    @staticmethod
    def states(
        blocks: nn.ModuleList, h: torch.Tensor, tokens: torch.Tensor, embed: Callable
    ) -> list[torch.Tensor]:
        return [block(h) for block in blocks]

    @staticmethod
    def draft(blocks, h: torch.Tensor, token: int, n: int, embed: nn.Module, lm_head) -> torch.Tensor:
        return lm_head(torch.stack([block(h) for block in blocks[:n]]))


class Sequential(BlockForm):
    """A chain: each depth reads the previous depth's state and the token it predicts."""

    @staticmethod
    def block(dim: int, intermediate: int) -> nn.Module:
        return Depth(dim, intermediate)

    @staticmethod
    def states(
        blocks: nn.ModuleList, h: torch.Tensor, tokens: torch.Tensor, embed: Callable
    ) -> list[torch.Tensor]:
        out, x = [], h
        for d, block in enumerate(blocks, start=1):
            ahead = torch.cat([tokens[:, d:], tokens[:, -1:].expand(-1, d)], 1)  # [B, T]: token t+d
            x = block(x, embed(ahead).to(x.dtype))
            out.append(x)
        return out

    @staticmethod
    def draft(blocks, h: torch.Tensor, token: int, n: int, embed: nn.Module, lm_head) -> torch.Tensor:
        rows, x = [], h
        for block in blocks[:n]:
            x = block(x, embed(torch.tensor(token)).to(x.dtype))
            rows.append(lm_head(x))
            token = int(rows[-1].argmax())
        return torch.stack(rows)


HEAD_FORMS.register("medusa", "residual MLP heads in parallel (Medusa-1); exports to vLLM's Medusa")(Medusa)
HEAD_FORMS.register("sequential", "DeepSeek-V3-style chain of one-row transformer blocks")(Sequential)


class Heads(nn.Module):
    """Heads 2..K. `states` gives each head's pre-LM-head hidden states; logits come from the shared head."""

    feature_layers: tuple[int, ...] = ()  # they read the final state only

    def __init__(self, form: str, k: int, dim: int, intermediate: int | None = None) -> None:
        super().__init__()
        self.shape = HEAD_FORMS.get(form)  # the form's block, training states and drafting
        self.form, self.k, self.dim = form, k, dim
        self.intermediate = intermediate or 2 * dim
        self.blocks = nn.ModuleList(
            self.shape.block(dim, self.intermediate) for _ in range(k - 1)
        )  # head i + 2

    def config(self) -> dict:
        return {"form": self.form, "k": self.k, "dim": self.dim, "intermediate": self.intermediate}

    def states(self, h: torch.Tensor, tokens: torch.Tensor, embed: Callable) -> list[torch.Tensor]:
        """Training: [B, T, D] per head k = 2..K; row t of head k predicts token t+k.

        The sequential chain is teacher-forced: depth d at row t reads the true token t+d (rows whose
        token lies past the end read the last token; their predictions have no target anyway).
        """
        return self.shape.states(self.blocks, h, tokens, embed)

    def draft_logits(self, h: torch.Tensor, token: int, n: int, embed: nn.Module, lm_head) -> torch.Tensor:
        """Decoding: logits [n, V] of heads 2..n+1 from one row's hidden state [D], given the token after it.

        Medusa heads share one LM-head call; the sequential chain feeds each depth the previous depth's
        greedy token, so it calls the LM head once per depth.
        """
        return self.shape.draft(self.blocks, h, token, n, embed, lm_head)

    def drafter(self, embed: nn.Module, lm_head) -> RowDrafter:
        """A sequence's drafter (decode.protocol.Drafter): the heads read one row and keep nothing."""
        return RowDrafter(partial(self.draft_logits, embed=embed, lm_head=lm_head))


class RowDrafter:
    """decode.protocol.Drafter for heads that draft from the last committed row alone."""

    keeps_state = False  # nothing to commit: the loop skips building the committed rows

    def __init__(self, draft) -> None:
        self.draft = draft  # (row [D], next token, n) -> [n, V]

    def block(self, start: int, rows: torch.Tensor, tokens: list[int], n: int) -> torch.Tensor:
        return self.draft(rows[-1], tokens[-1], n)

    def commit(self, start: int, rows: torch.Tensor, tokens: list[int]) -> None:
        pass


def head_lr_scale(k: int) -> float:
    """Per-head learning rates generalised by distance: heads 1-3 x1, 4-6 x0.8, 7-9 x0.5,
    then x0.8 per further group of three."""
    group = (k - 1) // 3
    return (1.0, 0.8, 0.5)[group] if group < 3 else 0.5 * 0.8 ** (group - 2)


def head_weights(k: int, alpha: str, progress: float) -> list[float]:
    """Loss weight of heads 2..K. 'decay' = 0.9^k, any number r = r^k, 'deepseek' = lambda/D
    with lambda 0.3 for the first 68 % of training (10T of 14.8T tokens), then 0.1."""
    if alpha == "deepseek":
        lam = 0.3 if progress < 10 / 14.8 else 0.1
        return [lam / (k - 1)] * (k - 1)
    rate = 0.9 if alpha == "decay" else float(alpha)
    return [rate**j for j in range(2, k + 1)]
