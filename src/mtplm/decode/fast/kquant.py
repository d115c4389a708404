"""GGUF's K-quants (Q4_K, Q5_K, Q6_K: super-blocks of 256 weights) in quant.py's records, and back.

The file's super-block (llama.cpp's block_q4_K, block_q5_K, block_q6_K):
- Q4_K, 144 bytes: fp16 d and dmin, 12 bytes packing 6-bit scale sc_j and min m_j of its 8 sub-blocks of 32,
  128 bytes of 4-bit codes q; a weight is (d * sc_j) * q - (dmin * m_j);
- Q5_K, 176 bytes: Q4_K's d, dmin and 12 bytes of scales and mins, then 32 bytes qh (byte l's bit j: the fifth
  bit (16) of sub-block j's input l), then Q4_K's 128 bytes of low 4 bits; codes q 0..31, Q4_K's formula;
- Q6_K, 210 bytes: 128 bytes of low 4 bits, 64 of high 2 bits (codes q, 0..63), 16 int8 scales sc (one per
  16 weights), fp16 d; a weight is (d * sc) * (q - 32).

pack() repacks them once, per 16 outputs and 32 inputs (one activation block) a record, the record's
sub-block scales beside its codes so that the kernels read one stream (csrc/quant.cpp's layout):
- Q4_K, 288 bytes: the Q4 nibble record (256 bytes), then sc_j of the 16 outputs (16 bytes), then m_j (16);
- Q5_K, 352 bytes: the Q4 nibble record of the low 4 bits (256), Q5_0's 8 64-bit masks of the fifth bits
  (64: mask t's bit 4 o + j is output o's input 4t + j), then sc_j (16) and m_j (16) as Q4_K's;
- Q6_K, 416 bytes: the low 4 bits as a Q4 nibble record (256), the high 2 bits (128: vector u's byte
  (o, j), bits 2i and 2i + 1, is output o's input 4 (4u + i) + j), then the int8 scale of inputs 0-15 of the
  16 outputs (16 bytes) and of inputs 16-31 (16);
and per 16 outputs and super-block the fp16 d (then dmin, Q4_K) of the 16 outputs: scales [Mp / 16, K / 256,
16 S]. So Q6_K keeps the file's 6.5625 bits a weight, Q4_K takes 4.625 (the file: 4.5) and Q5_K 5.625 (5.5).
"""

from __future__ import annotations

import torch

SUPER = 256  # weights per super-block
FILE_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # a super-block's bytes in the file
RECORD_BYTES = {"Q4_K": 288, "Q5_K": 352, "Q6_K": 416}  # a record's bytes (16 outputs x 32 inputs)
SUPER_SCALES = {"Q4_K": 2, "Q5_K": 2, "Q6_K": 1}  # fp16 values per output and super-block (d, then dmin)


def _half(pair: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] -> float16 [...] (little-endian fp16 bits)."""
    return pair.contiguous().view(torch.float16).squeeze(-1)


def decode(kind: str, raw: torch.Tensor, m: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The file's bytes uint8 [M, K / 256 * bytes] -> (codes uint8 [M, K] (Q4_K 0..15, Q5_K 0..31, Q6_K
    0..63), per block of 32 uint8 [M, K / 32, 2] (Q4_K, Q5_K: sc_j, m_j; Q6_K: the two int8 scales' bytes),
    fp16 [M, K / 256, S])."""
    blocks = raw.reshape(m, k // SUPER, FILE_BYTES[kind])
    if kind == "Q6_K":
        return _decode_q6_k(blocks, m, k)
    packed = blocks[..., 4:16].to(torch.int32).reshape(m, -1, 3, 4)
    low, mins, rest = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = torch.cat([low & 63, (rest & 15) | ((low >> 2) & 48)], dim=-1)  # [M, S, 8]
    mn = torch.cat([mins & 63, (rest >> 4) | ((mins >> 2) & 48)], dim=-1)
    qs = blocks[..., -128:].reshape(m, -1, 4, 1, 32)  # sub-block 2c + s: byte c's nibble s
    codes = torch.cat([qs & 15, qs >> 4], dim=3).reshape(m, -1, 8, 32)  # [M, S, sub-block, input]
    if kind == "Q5_K":  # sub-block j's input l: bit j of qh byte l
        qh = blocks[..., 16:48].reshape(m, -1, 1, 32)
        codes = codes | (((qh >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1) << 4)
    extra = torch.stack([sc, mn], dim=-1).to(torch.uint8).reshape(m, k // 32, 2)
    supers = torch.stack([_half(blocks[..., 0:2]), _half(blocks[..., 2:4])], dim=-1)
    return codes.reshape(m, k), extra, supers


def _decode_q6_k(blocks: torch.Tensor, m: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ql = blocks[..., :128].reshape(m, -1, 2, 1, 64)  # weight 128 h + 64 s + l: byte 64 h + l's nibble s
    low = torch.cat([ql & 15, ql >> 4], dim=3).reshape(m, -1, SUPER)
    qh = blocks[..., 128:192].reshape(m, -1, 2, 1, 32)  # weight 128 h + 32 s + l: byte 32 h + l's bits 2s
    high = torch.cat([(qh >> (2 * s)) & 3 for s in range(4)], dim=3).reshape(m, -1, SUPER)
    codes = (low | (high << 4)).reshape(m, k)
    extra = blocks[..., 192:208].reshape(m, k // 32, 2)
    return codes, extra, _half(blocks[..., 208:210])[..., None]


def pack(kind: str, raw: torch.Tensor, m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The file's bytes -> (codes uint8 [Mp / 16, K / 32, record], scales fp16 [Mp / 16, K / 256, 16 S])."""
    codes, extra, supers = decode(kind, raw, m, k)
    mp, kb = -(-m // 16) * 16, k // 32
    g = mp // 16
    if mp > m:  # padding outputs: zero codes, scales and mins
        codes = torch.cat([codes, codes.new_zeros(mp - m, k)])
        extra = torch.cat([extra, extra.new_zeros(mp - m, kb, 2)])
        supers = torch.cat([supers, supers.new_zeros(mp - m, *supers.shape[1:])])
    q = codes.reshape(g, 16, kb, 32).transpose(1, 2)  # [G, Kb, o, input]
    nibbles = (q & 15).reshape(g, kb, 16, 2, 4, 4)  # [G, Kb, o, half, v, j]
    parts = [(nibbles[:, :, :, 0] | (nibbles[:, :, :, 1] << 4)).transpose(2, 3).reshape(g, kb, 256)]
    if kind == "Q6_K":
        high = (q >> 4).reshape(g, kb, 16, 2, 4, 4)  # [G, Kb, o, u, i, j]
        bits = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)
        parts.append(bits.transpose(2, 3).reshape(g, kb, 128))  # [G, Kb, u, o, j]
    if kind == "Q5_K":  # mask t's bit 4 o + j: output o's input 4t + j
        fifth = (q >> 4).reshape(g, kb, 16, 8, 4).transpose(2, 3).reshape(g, kb, 8, 8, 8).to(torch.int32)
        parts.append((fifth << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8).reshape(g, kb, 64))
    parts.append(extra.reshape(g, 16, kb, 2).permute(0, 2, 3, 1).reshape(g, kb, 32))
    width = SUPER_SCALES[kind]
    scales = supers.reshape(g, 16, k // SUPER, width).permute(0, 2, 3, 1).reshape(g, k // SUPER, 16 * width)
    return torch.cat(parts, dim=-1).contiguous(), scales.contiguous()


def unpack(
    kind: str, codes: torch.Tensor, scales: torch.Tensor, m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack()'s records -> (codes int32 [M, K] (Q6_K: q - 32, the value its scale multiplies), per block of 32
    int32 [M, K / 32, 2] (Q4_K, Q5_K: sc_j, m_j; Q6_K: the two signed scales), float32 [M, K / 256, S])."""
    g, kb = codes.shape[:2]
    low = codes[..., :256].reshape(g, kb, 4, 16, 4).to(torch.int32)
    q = torch.cat([low & 15, low >> 4], dim=2)  # [G, Kb, t, o, j]: input 4t + j
    extra = codes[..., -32:].reshape(g, kb, 2, 16)
    if kind == "Q6_K":
        bits = codes[..., 256:384].reshape(g, kb, 2, 1, 16, 4).to(torch.int32)
        high = torch.cat([(bits >> (2 * i)) & 3 for i in range(4)], dim=3).reshape(g, kb, 8, 16, 4)
        q = (q | (high << 4)) - 32
        extra = extra.contiguous().view(torch.int8)
    if kind == "Q5_K":
        masks = codes[..., 256:320].reshape(g, kb, 8, 8, 1).to(torch.int32)
        fifth = ((masks >> torch.arange(8, dtype=torch.int32)) & 1).reshape(g, kb, 8, 16, 4)
        q = q | (fifth << 4)
    values = q.permute(0, 3, 1, 2, 4).reshape(g * 16, kb * 32)[:m]
    per_block = extra.permute(0, 3, 1, 2).reshape(g * 16, kb, 2)[:m].to(torch.int32)
    width = scales.shape[-1] // 16
    supers = scales.float().reshape(g, -1, width, 16).permute(0, 3, 1, 2).reshape(g * 16, -1, width)[:m]
    return values, per_block, supers


def block_scales(
    kind: str, per_block: torch.Tensor, supers: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """unpack()'s scales -> the float32 d_w [M, K / 32] each block's integer dot is scaled by (Q4_K, Q5_K:
    d * sc_j, exact; Q6_K: d) and their m_w = -(dmin * m_j) [M, K / 32] (exact; Q6_K: None)."""
    d = supers[..., 0].repeat_interleave(SUPER // 32, dim=1)
    if kind == "Q6_K":
        return d, None
    dmin = supers[..., 1].repeat_interleave(SUPER // 32, dim=1)
    return d * per_block[..., 0].float(), -(dmin * per_block[..., 1].float())
