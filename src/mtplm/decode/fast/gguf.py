"""The fast pass over a GGUF's own blocks: each linear weight a quant.QuantWeight packed from its bytes.

A model loaded with `--dtype gguf` (or `auto` where every block type is supported) holds no float copy of
its linear weights (assets/quantized.py); FastWeights packs them from the GGUF one tensor at a time, each
read 4096 rows at a time (quant.pack_rows), so the process keeps the packed blocks only, about the file's
size, and never holds a tensor's bytes whole beside them. q, k and v (and
gate and up) are fused into one product where their block types agree, by stacking their rows of blocks;
else each runs on its own. Biases, norms and the gated adapters are float tensors as
with bf16 weights; the adapters' low-rank delta runs beside the quantized product (forward.project).

The embedding's rows are read from the GGUF on demand (assets/embedding.py; `embed`, an op of its own).
The LM head, tied or not, is the GGUF's quantized one (QuantHead); rows the model has beyond the GGUF's
(a converted checkpoint's `<mtp>` row, never predicted) come from the model's own float head.

quant.linear quantizes its activations to int8 per 32 inputs, as llama.cpp does: logits differ from the
dequantized model's by that rounding, while every decoding mode on these weights is lossless relative to
this quantized model (its kernels give a row the same result whatever the rows beside it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mtplm.assets import embedding
from mtplm.assets.quantized import GGUFLinear, GGUFWeights
from mtplm.config import BACKEND_ENV
from mtplm.decode.fast import fewrow, kernels, quant
from mtplm.decode.sampling import greedy as argmax_of

log = logging.getLogger(__name__)


def products(linears: list[GGUFLinear], bases: list[nn.Linear], fuse: bool) -> list[quant.QuantLinear]:
    """A projection group's products over its parts' GGUF blocks (layers.Projection's): one fused where
    `fuse` and the parts share their block type, else one per part. Biases (float32) ride in the product.
    Each is packed from the file a chunk of rows at a time (quant.pack_rows), never read whole."""
    kinds = {linear.kind for linear in linears}
    if fuse and len(kinds) == 1 and len({linear.in_features for linear in linears}) == 1:
        out = sum(linear.out_features for linear in linears)
        weight = quant.pack_rows(linears[0].kind, _stacked(linears), out, linears[0].in_features)
        return [quant.QuantLinear(weight, _bias(bases))]
    return [
        quant.QuantLinear(
            quant.pack_rows(linear.kind, linear.rows, linear.out_features, linear.in_features), _bias([base])
        )
        for linear, base in zip(linears, bases, strict=True)
    ]


def _stacked(linears: list[GGUFLinear]) -> Callable[[int, int], torch.Tensor]:
    """read(start, count): rows [start, start + count) of the parts' bytes stacked in order (one block type
    and width), each part's read from the file."""
    begins = [sum(linear.out_features for linear in linears[:i]) for i in range(len(linears))]

    def read(start: int, count: int) -> torch.Tensor:
        pieces = [
            linear.rows(low - begin, high - low)
            for linear, begin in zip(linears, begins, strict=True)
            if (low := max(start, begin)) < (high := min(start + count, begin + linear.out_features))
        ]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    return read


def _bias(bases: list[nn.Linear]) -> torch.Tensor | None:
    """The parts' stacked biases in float32, zeros where a part has none (Qwen2: q, k, v biased); None where
    none has."""
    if all(base.bias is None for base in bases):
        return None
    return torch.cat(
        [
            base.bias.detach().float() if base.bias is not None else torch.zeros(base.out_features)
            for base in bases
        ]
    )


class QuantHead:
    """The LM head over the GGUF's quantized head: hidden [..., D] -> logits [..., V] (float32 before the
    caller's cast). `head` [V, D] is the model's own (float, or meta where it holds none): its rows past the
    GGUF's, if any, are products in float32 (on meta: -inf, never predicted)."""

    def __init__(self, source: GGUFLinear, head: torch.Tensor) -> None:
        self.weight = quant.pack_rows(source.kind, source.rows, source.out_features, source.in_features)
        self.extra = head[source.out_features :].detach()  # [V - V_gguf, D]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        logits = quant.linear(flat.float(), self.weight)  # [N, V_gguf] float32
        if len(self.extra):
            if self.extra.is_meta:
                extra = logits.new_full((len(flat), len(self.extra)), float("-inf"))
            else:
                extra = flat.float() @ self.extra.float().T
            logits = torch.cat([logits, extra], dim=-1)
        return logits.view(*hidden.shape[:-1], logits.shape[-1])

    def argmax(self, hidden: torch.Tensor, mask_id: int) -> torch.Tensor:
        """Greedy tokens [N] of hidden [..., D]: exactly `greedy` of this head's logits with column `mask_id`
        (-1: none) at -inf, without building those logits where every row past the GGUF's is -inf (on meta):
        those never win a row whose GGUF columns are not all -inf, and then the first maximal index is 0 in
        both. Where the extra rows hold weights, the full logits decide."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        if len(self.extra) and not self.extra.is_meta:
            logits = self(flat)
        else:
            logits = quant.linear(flat.float(), self.weight)
        if 0 <= mask_id < logits.shape[-1]:
            logits[:, mask_id] = float("-inf")
        return argmax_of(logits)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight.codes, self.weight.scales, *([] if self.extra.is_meta else [self.extra])]


def greedy(head: Any, mask_id: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A GGUF head's greedy tokens without its full logits (QuantHead.argmax); None for any other head."""
    return partial(head.argmax, mask_id=mask_id) if isinstance(head, QuantHead) else None


def head_logits(hidden: torch.Tensor, head: Any) -> torch.Tensor:
    """hidden [..., D] through the fast backend's head: a QuantHead, or a weight packed by kernels.pack."""
    return head(hidden) if isinstance(head, QuantHead) else kernels.packed_linear(hidden, head, None)


def held(weights: nn.Module, head: Any) -> list[torch.Tensor]:
    """Every tensor the fast backend holds for its weights (buffers: the QuantLinears' too) and its head."""
    tensors = [*weights.buffers(), *weights.parameters()]
    if isinstance(head, QuantHead):
        return tensors + head.tensors()
    return tensors + ([head] if head is not None else [])


def decode_dtype(dtype: str, backend: str = "auto") -> str:
    """The --dtype a decoding command loads with: "auto" stays "auto" (the GGUF's own blocks where every
    type is supported: assets/quantized.py) where the backend is not the eager one and quant's kernels run
    here; else "bf16" (the reference product would be far too slow to decode with), saying why once."""
    if dtype != "auto":
        return dtype
    name = os.environ.get(BACKEND_ENV, "auto") if backend == "auto" else backend
    if name == "eager":
        return "bf16"
    if not quant.load():
        why = fewrow.unavailable() or "no quant_linear in its build"
        log.info(f"[mtplm] GGUF block kernels are not available here ({why}): running bf16 weights")
        return "bf16"
    return dtype


@torch.library.custom_op("mtplm_gguf::embedding", mutates_args=())
def _embedding(
    ids: torch.Tensor,
    row_ids: torch.Tensor,
    rows: torch.Tensor,
    path: str,
    offset: int,
    row_bytes: int,
    kind: str,
    gguf_rows: int,
) -> torch.Tensor:
    source = GGUFLinear("token_embd.weight", kind, gguf_rows, rows.shape[-1], Path(path), offset, row_bytes)
    return embedding.lookup(source, ids, row_ids, rows)


@_embedding.register_fake
def _embedding_shape(ids, row_ids, rows, path, offset, row_bytes, kind, gguf_rows) -> torch.Tensor:
    return rows.new_empty(*ids.shape, rows.shape[-1])


def embed(weights: Any, ids: torch.Tensor) -> torch.Tensor:
    """The embeddings [*ids.shape, D] of `ids`: FastWeights' `embed` rows, or where the model's embedding is
    its GGUF's (assets/embedding.py) the rows it reads from the file (an op of its own, so a compiled graph
    calls it as it is)."""
    source = weights.embed_source
    if source is None:
        return F.embedding(ids, weights.embed)
    if not torch.compiler.is_compiling():  # eager: no custom op's dispatch (the op is for graphs)
        return embedding.lookup(source, ids, weights.embed_ids, weights.embed)
    return torch.ops.mtplm_gguf.embedding(
        ids, weights.embed_ids, weights.embed, str(source.path), source.offset, source.row_bytes, source.kind,
        source.out_features,
    )  # fmt: skip


def source(model: Any) -> GGUFWeights | None:
    return getattr(model, "gguf", None)
