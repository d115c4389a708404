"""Greedy tokens from the LM head at about half of its weight traffic, bitwise the argmax of its logits.

Greedy decoding needs only each row's argmax, yet the head's bf16 weights (57 MB for SmolLM2, ~2.2 ms a
pass from memory) are read whole every pass. `GreedyHead` keeps an int8 copy: the kernel
(csrc/head.cpp, `mtplm_fewrow::head_argmax`) bounds every token's logit from it, and computes again, with
the bf16 kernel the full head runs, only the tokens whose upper bound reaches the row's best lower bound. A
logit does not depend on the other rows or outputs of that product, so the token chosen is the full head's
`argmax(-1)` (its first maximal index) exactly; on SmolLM2 a row left a median of 4 candidates
(docs/backends-kernels.md).
"""

from __future__ import annotations

import os

import torch

from mtplm.decode.fast import fewrow

BLOCK = 16  # tokens per packed block (fewrow.cpp, head.cpp)
MAX_ROWS = 16  # rows one head_argmax call takes (more: the full head, one read of it for up to 32 rows)


def int8_codes(weight: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [V, D] -> (codes [Vp, 1, Dp] int8 in head.cpp's layout, stats [4, Vp] float32): per token
    its scale, largest rounding residual, scale * |codes|_1, and 127 * scale + residual (>= max |weight|).
    `chunk` tokens at a time, so a large vocabulary never takes a float32 copy of the whole head."""
    v, d = weight.shape
    vp, dp = -(-v // BLOCK) * BLOCK, -(-d // 64) * 64
    padded = torch.zeros(vp, dp, dtype=torch.int8)
    stats = torch.zeros(4, vp)
    for start in range(0, v, chunk):
        wide = weight[start : start + chunk].detach().float()
        rows = slice(start, start + len(wide))
        scale = (wide.abs().amax(dim=1) / 127).clamp(min=1e-30)
        codes = torch.round(wide / scale[:, None]).clamp(-127, 127)
        residual = (wide - codes * scale[:, None]).abs().amax(dim=1)  # ulps of 127 * scale short at most
        residual = residual * 1.001 + 127 * scale * 2**-21
        padded[rows, :d] = codes.to(torch.int8)
        stats[0, rows], stats[1, rows] = scale, residual
        stats[2, rows] = scale * codes.abs().sum(dim=1)
        stats[3, rows] = 127 * scale + residual
    packed = padded.view(vp // BLOCK, BLOCK, dp // 4, 4).permute(0, 2, 1, 3).contiguous()
    return packed.view(vp, 1, dp), stats


class GreedyHead:
    """hidden [..., D] bf16 -> token ids [N]: the argmax of fewrow's linear(hidden, packed) [N, V] with
    `mask_id` (-1: none) never chosen. `packed`: the head's weight [V, D] `weight` in fewrow's layout."""

    def __init__(self, weight: torch.Tensor, packed: torch.Tensor, mask_id: int) -> None:
        self.codes, self.stats = int8_codes(weight)
        self.packed, self.vocab, self.mask_id = packed, weight.shape[0], mask_id

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        if len(flat) > MAX_ROWS:  # the copy read once per 16 rows would cost more than one read of the head
            return self._full(flat)
        tokens = torch.ops.mtplm_fewrow.head_argmax(
            flat, self.codes, self.stats, self.packed, self.vocab, self.mask_id
        )
        if bool((tokens < 0).any()):  # a row of NaN or inf: the full head's logits decide, as they would
            return self._full(flat)
        return tokens

    def _full(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.ops.mtplm_fewrow.linear(hidden, self.packed, None).float()
        if self.mask_id >= 0:
            logits[:, self.mask_id] = float("-inf")
        return logits.max(dim=-1).indices


def for_head(weight: torch.Tensor, packed: torch.Tensor | None, mask_id: int) -> GreedyHead | None:
    """A GreedyHead for a head packed in fewrow's layout (`packed` from kernels.pack) where the kernels run on
    AMX, AVX-512 with VNNI or AVX2 (csrc/head*.cpp), else None: greedy tokens then come from the full head's
    logits (as with MTPLM_GREEDY_HEAD=0, for comparisons)."""
    if os.environ.get("MTPLM_GREEDY_HEAD", "1") == "0":
        return None
    if not isinstance(packed, torch.Tensor) or packed.dim() != 3 or weight.dtype != torch.bfloat16:
        return None
    if fewrow.isa() == "avx512" and "avx512_vnni" not in fewrow.cpu_flags():
        return None
    return GreedyHead(weight, packed, mask_id)


def copies(argmax: object) -> list[torch.Tensor]:
    """The tensors a backend's greedy path holds beside the head (a GreedyHead's int8 copy)."""
    return [argmax.codes, argmax.stats] if isinstance(argmax, GreedyHead) else []
