"""GGUF K-quant blocks for tests: a plain quantizer to Q4_K, Q5_K and Q6_K (gguf-py dequantizes them but
cannot quantize; llama.cpp's own search for scales is better, the layout is the same), and random valid
bytes."""

from __future__ import annotations

import numpy as np

FILE_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def quantize(weight: np.ndarray, kind: str) -> np.ndarray:
    """float32 [M, K] (K a multiple of 256) -> the file's bytes uint8 [M, K / 256 * block bytes]."""
    m, k = weight.shape
    x = weight.reshape(m * k // 256, 256).astype(np.float32)
    blocks = _q6_k(x) if kind == "Q6_K" else _q4_k(x, fifth=kind == "Q5_K")
    return blocks.reshape(m, -1)


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(len(values), 2)


def _q4_k(x: np.ndarray, fifth: bool) -> np.ndarray:
    """Q4_K (codes 0..15), or with `fifth` Q5_K (0..31: their fifth bits in qh before the low nibbles)."""
    top = 31 if fifth else 15
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - low) / top
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (-low.min(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[:, None]), 1, 63).astype(np.int32)
    mn = np.clip(np.round(-low / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.int32)
    step = d[:, None] * sc
    shifted = sub + (dmin[:, None] * mn)[..., None]
    q = np.clip(np.round(shifted / np.where(step > 0, step, 1)[..., None]), 0, top).astype(np.uint8)
    packed = np.zeros((len(x), 12), dtype=np.uint8)
    packed[:, 0:4] = (sc[:, :4] | ((sc[:, 4:] >> 4) << 6)).astype(np.uint8)
    packed[:, 4:8] = (mn[:, :4] | ((mn[:, 4:] >> 4) << 6)).astype(np.uint8)
    packed[:, 8:12] = ((sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)).astype(np.uint8)
    pairs = (q & 15).reshape(-1, 4, 2, 32)  # sub-block 2c + s: byte c's nibble s
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    parts = [_f16(d), _f16(dmin), packed, qs]
    if fifth:  # qh byte l's bit j: sub-block j's input l
        qh = ((q >> 4).astype(np.uint32) << np.arange(8, dtype=np.uint32)[:, None]).sum(1).astype(np.uint8)
        parts.insert(3, qh)
    return np.concatenate(parts, axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[:, None]), 1, 127).astype(np.int32)
    step = d[:, None] * sc
    q = np.clip(np.round(sub / np.where(step > 0, step, 1)[..., None]), -32, 31).astype(np.int32) + 32
    q = q.reshape(-1, 2, 128)  # weight 128 h + 64 s + l: ql byte 64 h + l's nibble s
    ql = ((q[:, :, :64] & 15) | ((q[:, :, 64:] & 15) << 4)).reshape(-1, 128)
    high = (q >> 4).reshape(-1, 2, 4, 32)  # weight 128 h + 32 s + l: qh byte 32 h + l's bits 2s
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate(
        [ql.astype(np.uint8), qh.astype(np.uint8), sc.astype(np.int8).view(np.uint8), _f16(d)], axis=1
    )


def random_bytes(kind: str, m: int, k: int, seed: int = 0) -> np.ndarray:
    """Any codes and scales a file could hold (Q6_K's scale -128 too) under random finite fp16 d, dmin."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(m, k // 256, FILE_BYTES[kind]), dtype=np.uint8)
    halves = (rng.standard_normal((m, k // 256, 2)) / 64).astype(np.float16).view(np.uint8)
    if kind != "Q6_K":
        raw[..., 0:4] = halves.reshape(m, k // 256, 4)
    else:
        raw[..., 208:210] = halves[..., :2]
    return raw.reshape(m, -1)
