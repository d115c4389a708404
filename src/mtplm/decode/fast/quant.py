"""Few-row products over GGUF's quantized blocks as the file holds them (Q8_0, Q4_0, Q4_1, Q5_0, and the
K-quants Q4_K, Q5_K, Q6_K: kquant.py): the weights stay 4- to 8-bit in memory, and each product is integer dot
products of int8-quantized activations with the block codes (csrc/quant*.cpp: AVX-512 VNNI, else AVX2),
built into fewrow.py's library as `mtplm_fewrow::quant_linear`.

The math, every ISA and `reference` alike (so every path gives the same bits):
- a row's activations, per block of 32 inputs: d_x = max|x| / 127, q_x = round-half-even(x * (127 / max|x|))
  (int8), s_x = sum of q_x (all float32 ops, IEEE);
- a weight block of output o: codes q_w and fp16 scale d_w (and min m_w, Q4_1), standing for
  d_w * (q_w - offset) (Q8_0: offset 0, Q4_0: 8, Q5_0: 16) or d_w * q_w + m_w (Q4_1); Q4_K and Q5_K are
  Q4_1's math with d_w = d * sc_j and m_w = -(dmin * m_j) (float32, exact) per block; Q6_K's block is two
  halves of 16 inputs, each with its int8 scale sc_h: d_w = the super-block's d, and dot_b below is the exact
  integer sc_0 * dot_0 + sc_1 * dot_1 over the halves' integer dots of q_x with (q_w - 32);
- per block b, in order b = 0, 1, ...: acc = fma(float(dot_b), d_w * d_x, acc), dot_b the exact integer dot of
  q_x with (q_w - offset), then for Q4_1, Q4_K and Q5_K acc = fma(m_w, d_x * float(s_x), acc); then + bias
  (float32), then rounded to x's dtype. A row's outputs depend on that row alone: bitwise the same among any
  rows, threads.

pack() repacks a GGUF tensor's bytes once (the layout is csrc/quant.cpp's): codes uint8 [Mp/16, K/32, C]
(16 outputs x 32 inputs a record: Q4 256 bytes, Q5_0 320, Q8_0 512) and scales float16 [Mp/16, K/32, 16 S]
(d_w for 16 outputs, then m_w for Q4_1), Mp = M rounded up to 16: the file's bits per weight, no more. The
K-quants' records and scales: kquant.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mtplm.decode.fast import fewrow, kquant

# GGUF type -> (bytes a 32-weight block takes in the file, code bytes a 16-output record, scales a block)
_FORMATS = {"Q8_0": (34, 512, 1), "Q4_0": (18, 256, 1), "Q4_1": (20, 256, 2), "Q5_0": (22, 320, 1)}
BLOCK_TYPES = (*_FORMATS, *kquant.FILE_BYTES)
_OFFSETS = {"Q8_0": 0, "Q4_0": 8, "Q4_1": 0, "Q5_0": 16}
_READY: dict[str, bool] = {}  # "ops": whether quant_linear is loaded (its fake registered); set by load()


@dataclass(frozen=True, eq=False)
class QuantWeight:
    """One GGUF weight [out_features, in_features] repacked for quant_linear (module docstring's layout)."""

    kind: str
    out_features: int
    in_features: int
    codes: torch.Tensor  # uint8 [Mp / 16, K / 32, record bytes]
    scales: torch.Tensor  # float16 [Mp / 16, K / 32 (K-quants: K / 256), 16 * scales per block]

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 2 * self.scales.numel()


def load() -> bool:
    """Whether the kernels run here (fewrow.load(): built and loaded); else linear() runs reference()."""
    if "ops" not in _READY:
        _READY["ops"] = fewrow.load() and hasattr(torch.ops.mtplm_fewrow, "quant_linear")
        if _READY["ops"]:
            torch.library.register_fake("mtplm_fewrow::quant_linear", _linear_shape)
    return _READY["ops"]


def _linear_shape(inputs, codes, scales, bias, kind: str, out_features: int) -> torch.Tensor:
    return inputs.new_empty(inputs.shape[0], out_features)


def file_block(kind: str) -> tuple[int, int]:
    """(weights, bytes) of one of the file's blocks of this type (ValueError for a type not supported)."""
    if kind in kquant.FILE_BYTES:
        return kquant.SUPER, kquant.FILE_BYTES[kind]
    if kind not in _FORMATS:
        raise ValueError(f"GGUF block type {kind} is not supported (supported: {', '.join(BLOCK_TYPES)})")
    return 32, _FORMATS[kind][0]


def _check(kind: str, in_features: int) -> tuple[int, int]:
    weights, block_bytes = file_block(kind)
    if in_features % weights or in_features <= 0:
        raise ValueError(
            f"a {kind} weight needs in features a positive multiple of {weights}, not {in_features}"
        )
    return weights, block_bytes


def pack(kind: str, raw: torch.Tensor, out_features: int, in_features: int) -> QuantWeight:
    """raw: the GGUF tensor's bytes as the file holds them, uint8 [M, K / block * block bytes] (rows are
    output channels) -> the kernel's layout. ValueError for a type not in BLOCK_TYPES or K not a multiple of
    its block (32; the K-quants 256)."""
    weights, block_bytes = _check(kind, in_features)
    m, k = out_features, in_features
    need = m * k // weights * block_bytes
    if raw.dtype != torch.uint8 or raw.numel() != need:
        raise ValueError(f"{kind} [{m}, {k}] needs {need} uint8 bytes, got {raw.numel()}")
    rows = raw.reshape(m, -1)
    return pack_rows(kind, lambda start, count: rows[start : start + count], m, k)


def pack_rows(
    kind: str,
    read: Callable[[int, int], torch.Tensor],
    out_features: int,
    in_features: int,
    chunk: int = 4096,
) -> QuantWeight:
    """pack() over `read(start, count)`, the file's bytes of outputs [start, start + count) (uint8 [count,
    row bytes]), `chunk` outputs at a time (a multiple of 16: the layout's records are 16 outputs) into the
    whole weight's tensors: packing holds the result and one chunk's bytes and temporaries, never a copy of
    the whole tensor (an LM head of 150k rows reads 4096 at a time)."""
    weights, block_bytes = _check(kind, in_features)
    load()
    m, k, groups = out_features, in_features, -(-out_features // 16)
    if kind in kquant.FILE_BYTES:
        record, scale_blocks, width = kquant.RECORD_BYTES[kind], k // kquant.SUPER, kquant.SUPER_SCALES[kind]
    else:
        record, scale_blocks, width = _FORMATS[kind][1], k // 32, _FORMATS[kind][2]
    codes = torch.empty(groups, k // 32, record, dtype=torch.uint8)
    scales = torch.empty(groups, scale_blocks, 16 * width, dtype=torch.float16)
    for start in range(0, m, chunk):
        rows = min(chunk, m - start)
        raw = read(start, rows)
        if raw.dtype != torch.uint8 or tuple(raw.shape) != (rows, k // weights * block_bytes):
            raise ValueError(f"{kind} rows [{start}, {start + rows}) need uint8 [{rows}, "
                             f"{k // weights * block_bytes}], got {raw.dtype} {list(raw.shape)}")  # fmt: skip
        pack_part = kquant.pack if kind in kquant.FILE_BYTES else _pack_blocks
        part_codes, part_scales = pack_part(kind, raw, rows, k)
        codes[start // 16 : start // 16 + len(part_codes)] = part_codes
        scales[start // 16 : start // 16 + len(part_scales)] = part_scales
    return QuantWeight(kind, m, k, codes, scales)


def _pack_blocks(kind: str, raw: torch.Tensor, m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 32-weight block types: the file's bytes [M, K / 32 * bytes] -> (codes, scales) of pack()'s
    layout for these M outputs (padded to 16)."""
    block_bytes, kb = _FORMATS[kind][0], k // 32
    mp = -(-m // 16) * 16
    blocks = torch.zeros(mp, kb, block_bytes, dtype=torch.uint8)
    blocks[:m] = raw.reshape(m, kb, block_bytes)
    groups = blocks.view(mp // 16, 16, kb, block_bytes).transpose(1, 2)  # [G, Kb, 16 outputs, block bytes]
    scale_bytes = 4 if kind == "Q4_1" else 2
    scales = groups[..., :scale_bytes].reshape(mp // 16, kb, 16, scale_bytes // 2, 2).transpose(2, 3)
    body = groups[..., scale_bytes:]
    if kind == "Q8_0":  # byte (t, o, j) = output o's input 4t + j
        codes = body.reshape(mp // 16, kb, 16, 8, 4).transpose(2, 3)
    else:  # GGUF's byte i holds inputs i (low nibble) and i + 16 (high): byte (t, o, j) = its byte 4t + j
        nibbles = body[..., -16:].reshape(mp // 16, kb, 16, 4, 4).transpose(2, 3)
        codes = nibbles.reshape(mp // 16, kb, 256)
        if kind == "Q5_0":
            codes = torch.cat([codes, _high_bit_masks(body[..., :4])], dim=-1)
    return (
        codes.reshape(mp // 16, kb, -1).contiguous(),
        scales.reshape(mp // 16, kb, -1).contiguous().view(torch.float16).reshape(mp // 16, kb, -1),
    )


def _high_bit_masks(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0's high bits qh [G, Kb, 16 outputs, 4 bytes] (bit e: input e's) -> per record 8 little-endian
    64-bit masks, mask t's bit 4 o + j being output o's input 4t + j."""
    bits = (qh[..., :, None].to(torch.int32) >> torch.arange(8, dtype=torch.int32)) & 1  # [G, Kb, 16, 4, 8]
    bits = bits.reshape(*qh.shape[:2], 16, 8, 4).transpose(2, 3)  # [G, Kb, t, o, j]
    bits = bits.reshape(*qh.shape[:2], 8, 8, 8)  # [G, Kb, t, byte, bit]
    weights = 1 << torch.arange(8, dtype=torch.int32)
    return (bits * weights).sum(-1).to(torch.uint8).reshape(*qh.shape[:2], 64)


def _codes(w: QuantWeight) -> torch.Tensor:
    """The codes as integers [M, K] (Q4_1, Q4_K, Q5_K: q_w; the others: q_w - offset, the signed value d_w
    (Q6_K: its half's scale) multiplies)."""
    if w.kind in kquant.FILE_BYTES:
        return kquant.unpack(w.kind, w.codes, w.scales, w.out_features)[0]
    g, kb = w.codes.shape[:2]
    if w.kind == "Q8_0":
        codes = w.codes.view(torch.int8).reshape(g, kb, 8, 16, 4).to(torch.int32)
    else:
        nibbles = w.codes[..., :256].reshape(g, kb, 4, 16, 4).to(torch.int32)
        codes = torch.cat([nibbles & 15, nibbles >> 4], dim=2)  # [G, Kb, t, o, j]
        if w.kind == "Q5_0":
            masks = w.codes[..., 256:].reshape(g, kb, 8, 8).to(torch.int32)
            bits = (masks[..., None] >> torch.arange(8, dtype=torch.int32)) & 1
            codes = codes | (bits.reshape(g, kb, 8, 16, 4) << 4)
    codes = codes - _OFFSETS[w.kind]
    return codes.permute(0, 3, 1, 2, 4).reshape(g * 16, kb * 32)[: w.out_features]


def _scales(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """d_w [M, K / 32] float32 and (Q4_1, Q4_K, Q5_K) m_w."""
    if w.kind in kquant.FILE_BYTES:
        _, per_block, supers = kquant.unpack(w.kind, w.codes, w.scales, w.out_features)
        return kquant.block_scales(w.kind, per_block, supers)
    g, kb, width = w.scales.shape
    both = (
        w.scales.float().reshape(g, kb, width // 16, 16).permute(2, 0, 3, 1).reshape(width // 16, g * 16, kb)
    )
    both = both[:, : w.out_features]
    return both[0], both[1] if w.kind == "Q4_1" else None


def dequantize(w: QuantWeight) -> torch.Tensor:
    """The float32 [M, K] values the GGUF tensor stands for (gguf.quants.dequantize's, bitwise)."""
    codes = _codes(w).float().reshape(w.out_features, -1, 32)
    d, m = _scales(w)
    if w.kind == "Q6_K":  # (d * sc_h) * (q_w - 32), as gguf computes it
        halves = _halves(w).float()
        values = (d[..., None] * halves)[..., None] * codes.reshape(w.out_features, -1, 2, 16)
        return values.reshape(w.out_features, w.in_features)
    values = d[..., None] * codes
    return (values if m is None else values + m[..., None]).reshape(w.out_features, w.in_features)


def _halves(w: QuantWeight) -> torch.Tensor:
    """Q6_K: the int8 scales of each block's two halves of 16 inputs, int32 [M, K / 32, 2]."""
    return kquant.unpack(w.kind, w.codes, w.scales, w.out_features)[1]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, K] -> (q_x int32 [N, K / 32, 32], d_x float32 [N, K / 32], s_x int32 [N, K / 32]): the kernel's
    per-block int8 activations, bitwise."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inverse[..., None]).clamp(-127, 127).to(torch.int32)
    return codes, amax / torch.tensor(127.0), codes.sum(-1)


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c rounded once to float32 (a, b, c float32): exact product and sum in float64, rounded to odd
    (TwoSum's error), then to nearest: the two roundings give the fused one."""
    p, c64 = a.double() * b.double(), c.double()
    t = p + c64
    back = t - p
    err = (p - (t - back)) + (c64 - back)
    even = (t.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.tensor(float("inf"), dtype=torch.float64), -torch.inf)
    return torch.where((err != 0) & even, torch.nextafter(t, toward), t).float()


def reference(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear()'s math in plain torch, the same operations in the same order: linear()'s bits."""
    _check(w.kind, w.in_features)
    qx, dx, sx = quantize_activations(x)
    if w.kind == "Q6_K":  # the halves' integer dots times their scales: exact integers
        codes = _codes(w).reshape(w.out_features, -1, 2, 16).double()
        halves = torch.einsum("nbhk,mbhk->bnmh", qx.reshape(*qx.shape[:2], 2, 16).double(), codes)
        dots = (halves * _halves(w).permute(1, 0, 2)[:, None].double()).sum(-1).float()
    else:
        codes = _codes(w).reshape(w.out_features, -1, 32).double()
        dots = torch.einsum("nbk,mbk->bnm", qx.double(), codes).float()  # exact integers
    d, m = _scales(w)
    acc = torch.zeros(x.shape[0], w.out_features)
    for b in range(dots.shape[0]):
        acc = _fma(dots[b], d[None, :, b] * dx[:, b, None], acc)
        if m is not None:
            acc = _fma(
                m[None, :, b].expand_as(acc), (dx[:, b] * sx[:, b].float())[:, None].expand_as(acc), acc
            )
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)


def linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, K] bf16 or float32 @ W^T (+ bias, float32 [M]) -> [N, M] in x's dtype (the module docstring's
    math; the kernel where load() is True, else reference())."""
    if _READY.get("ops"):
        return torch.ops.mtplm_fewrow.quant_linear(x, w.codes, w.scales, bias, w.kind, w.out_features)
    return reference(x, w, bias)


class QuantLinear(nn.Module):
    """A Linear over a QuantWeight (its tensors as buffers, so a compiled graph reads them as the model's):
    the forward runs linear(); `.weight` is the dequantized float32 copy."""

    codes: torch.Tensor
    scales: torch.Tensor

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.kind, self.in_features, self.out_features = weight.kind, weight.in_features, weight.out_features
        self.register_buffer("codes", weight.codes, persistent=False)
        self.register_buffer("scales", weight.scales, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    @property
    def quant(self) -> QuantWeight:
        return QuantWeight(self.kind, self.out_features, self.in_features, self.codes, self.scales)

    @property
    def weight(self) -> torch.Tensor:
        return dequantize(self.quant)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        flat = inputs.reshape(-1, self.in_features)
        out = linear(flat, self.quant, self.bias)
        return out.reshape(*inputs.shape[:-1], self.out_features)
