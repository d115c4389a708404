"""Linear layers over prepacked (oneDNN-blocked) bf16 weights, as one opaque op torch.compile can call, and
over weight-only int8 weights (per-output-channel scales) and int4 weights (group-wise scales and zeros).

PyTorch's bf16 F.linear on CPU hands oneDNN a plain [out, in] weight on every call; a weight reordered
once into oneDNN's blocked layout (mkldnn._reorder_linear_weight, what inductor's freezing pass does)
reads about twice as fast for the 1-32 row products of a decode pass. Inductor only lowers the packed
op for weights it froze into a graph as constants, which would copy every weight into every compiled
bucket; wrapped as a custom op, the packed weights stay ordinary inputs shared by all buckets.

Where it builds and runs (a C++ compiler, a CPU with avx512_bf16), `pack` and `packed_linear` use mtplm's own
few-row kernel instead (fewrow.py, csrc/fewrow.cpp; measured in docs/backends-kernels.md), an op of its own
the compiled graphs call the same way; a weight packed for it is 3-D ([M, 1, Kp]), oneDNN's 2-D.

Shapes: N rows (any leading dims), K in features, M out features.
"""

from __future__ import annotations

import torch

from mtplm.decode.fast import fewrow


def packed_bf16_supported() -> bool:
    return fewrow.onednn_bf16_supported() or fewrow.load()


def pack(weight: torch.Tensor, kernel: str = "auto") -> torch.Tensor:
    """weight [M, K] bf16 packed once for few-row products: for mtplm's own kernel where it loads (an opaque
    [M, 1, Kp] tensor; kernel "auto" or "fewrow"), else in oneDNN's blocked layout (an opaque [M, K] tensor;
    kernel "onednn")."""
    if kernel == "fewrow" and not fewrow.load():
        raise RuntimeError("mtplm's few-row kernel is not available here (its reason is on stderr)")
    if kernel == "fewrow" or (kernel == "auto" and weight.dtype == torch.bfloat16 and fewrow.load()):
        return fewrow.pack(weight)
    if not fewrow.onednn_bf16_supported():
        raise RuntimeError("oneDNN has no bf16 kernel on this CPU and mtplm's few-row kernel is not loaded")
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)


# Registered with torch.library directly (not the custom_op decorator, whose Python wrapper cost ~20 us
# a call in a profile: 120 calls a pass). Inputs are 2-D; callers flatten leading dims in the graph.
_LIBRARY = torch.library.Library("mtplm", "DEF")
_LIBRARY.define("packed_linear(Tensor inputs, Tensor packed, Tensor? bias) -> Tensor")


def _packed_linear(inputs: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(inputs, packed, bias, "none", [], "")  # [N, M]


_LIBRARY.impl(
    "packed_linear", _packed_linear, "CompositeExplicitAutograd"
)  # the packed weight is an MkldnnCPU tensor
torch.library.register_fake("mtplm::packed_linear", fewrow.linear_shape, lib=_LIBRARY)


def packed_linear(inputs: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """inputs [..., K] @ packed^T (+ bias) -> [..., M], by the kernel `pack` packed the weight for."""
    flat = inputs.reshape(-1, inputs.shape[-1])  # [N, K]
    if packed.dim() == 3:  # fewrow's layout
        out = torch.ops.mtplm_fewrow.linear(flat, packed, bias)
    else:
        out = torch.ops.mtplm.packed_linear(flat, packed, bias)
    return out.view(*inputs.shape[:-1], packed.shape[0])


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: weight [M, K] ~ q [M, K] * scales [M] (scales in weight's dtype)."""
    wide = weight.detach().float()
    scales = (wide.abs().amax(dim=1) / 127).clamp(min=1e-12)  # [M]
    q = torch.round(wide / scales.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales.to(weight.dtype)


def int8_linear(
    inputs: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """inputs [..., K] @ (q * scales)^T (+ bias) -> [..., M], with PyTorch's weight-only int8 kernel (reads
    half the bytes of bf16; measured on a 2-core Zen 4 over a 30-layer model: 1 row 1.7x faster than prepacked
    bf16, 8 rows 1.5x slower: its cost grows with the rows)."""
    flat = inputs.reshape(-1, inputs.shape[-1])  # [N, K]
    out = torch.ops.aten._weight_int8pack_mm(flat, q, scales.to(flat.dtype))
    out = out if bias is None else out + bias
    return out.view(*inputs.shape[:-1], q.shape[0])


INT4_GROUP = 32  # weights per (scale, zero) pair along K: llama.cpp's Q4 block size


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4 (llama.cpp's Q4_1 scheme): per `group` inputs of an output row, 16 levels
    from the group's min to its max. weight [M, K] -> (codes, scales and zeros) in the layout int4_linear
    runs: mtplm's few-row kernel's (csrc/int4.cpp: [M, 1, K / 2] uint8 and [M, 1, K / 16] bf16 over blocked
    storage) for bf16 weights where that kernel loads, else PyTorch's CPU int4 kernel's (packed [M', K / 2]
    uint8, scales_and_zeros [K / group, M', 2] in weight's dtype; M' = M rounded up to 16, zero rows)."""
    m, k = weight.shape
    if k % group:
        raise ValueError(f"int4 weights need in-features a multiple of {group}; this projection has {k}")
    padded = torch.cat([weight.detach().float(), weight.new_zeros(-m % 16, k).float()])  # [M', K]
    groups = padded.view(padded.shape[0], k // group, group)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scales = ((high - low) / 15).clamp(min=1e-12)
    q = torch.round((groups - low) / scales).clamp(0, 15).to(torch.int32).view_as(padded)
    zeros = low + 8 * scales  # the kernels dequantize (q - 8) * scale + zero
    if weight.dtype == torch.bfloat16 and group == 32 and fewrow.load() and fewrow.has_int4():
        return _few_row_int4(q, scales.squeeze(-1), zeros.squeeze(-1), m)
    scales_and_zeros = torch.cat([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(weight.dtype)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scales_and_zeros


def _few_row_int4(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes q [M', K] and float scales, zeros [M', K / 32] in csrc/int4.cpp's layout: per block of 16
    outputs and group of 32 inputs, 16 pairs x 16 bytes (byte l: lane l of outputs 0-7's pairs, and in its
    high nibble of outputs 8-15's), then 16 scales and 16 zeros in bf16."""
    rows, k = q.shape
    pairs = q.view(rows // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)  # [block, group, pair, output, 2]
    first, last = (
        half.reshape(rows // 16, k // 32, 16, 16) for half in (pairs[..., :8, :], pairs[..., 8:, :])
    )
    codes = (first | (last << 4)).to(torch.uint8).contiguous().view(-1)
    both = torch.stack([scales, zeros]).to(torch.bfloat16).view(2, rows // 16, 16, k // 32)
    blocked = both.permute(1, 3, 0, 2).contiguous().view(-1)  # [block, group, scale | zero, output]
    return (
        codes.as_strided((m, 1, k // 2), (k // 2, k // 2, 1)),
        blocked.as_strided((m, 1, k // 16), (k // 16, k // 16, 1)),
    )


def dequantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    """What quantize_int4's output stands for, [M, K] in weight's dtype (the reference the tests compare
    with)."""
    m, k = weight.shape
    groups = weight.detach().float().view(m, k // group, group)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scales = ((high - low) / 15).clamp(min=1e-12)
    q = torch.round((groups - low) / scales).clamp(0, 15)
    scales, zeros = scales.to(weight.dtype).float(), (low + 8 * scales).to(weight.dtype).float()
    return ((q - 8) * scales + zeros).view(m, k).to(weight.dtype)


def int4_linear(
    inputs: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    group: int = INT4_GROUP,
) -> torch.Tensor:
    """inputs [..., K] @ dequantized(packed)^T (+ bias) -> [..., M], with the kernel whose layout
    quantize_int4 chose: mtplm's few-row kernel or PyTorch's CPU int4 kernel."""
    flat = inputs.reshape(-1, inputs.shape[-1])  # [N, K]
    if packed.dim() == 3:  # csrc/int4.cpp's layout
        out = torch.ops.mtplm_fewrow.int4_linear(flat, packed, scales_and_zeros, bias)
        return out.reshape(*inputs.shape[:-1], out_features)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, group, scales_and_zeros.to(flat.dtype))
    out = out[:, :out_features]
    out = out if bias is None else out + bias
    return out.reshape(*inputs.shape[:-1], out_features)
