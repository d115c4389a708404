"""mtplm's own few-row bf16 kernels, one packed weight layout for every ISA (csrc/fewrow.cpp: AMX tiles where
the CPU has them, else AVX-512 vdpbf16ps, else AVX2 + FMA in float32): built once per CPU kind (BUILDS: the
AVX-512 build, or the AVX2 build for a CPU without avx512_bf16) into `$MTPLM_HOME/kernels/<kind>-<hash>` (or
`$MTPLM_KERNELS_DIR`) with torch.utils.cpp_extension and loaded as the ops `mtplm_fewrow::pack`,
`mtplm_fewrow::linear`, `mtplm_fewrow::lora_linear` (csrc/lora.cpp: a widened product with the gated adapters'
low-rank activations computed inside), `mtplm_fewrow::attend` (csrc/attend*.cpp: decode attention over the
bf16 or float32 KV store whose sums do not depend on the pass's shape), `mtplm_fewrow::mean_square`
(csrc/norm.cpp: RMSNorm's sum in one order), `mtplm_fewrow::head_argmax` (csrc/head*.cpp: greedy tokens
from an int8 copy of the LM head, greedy.py), `mtplm_fewrow::quant_linear` (csrc/quant*.cpp: products over
GGUF's blocks, quant.py) and, in the AVX-512 build only, `mtplm_fewrow::int4_linear` (csrc/int4.cpp). Every
kernel sums a row's outputs in one order whatever the rows beside it. `load()` is False where it cannot be
used (no compiler, a CPU with neither avx512_bf16 nor AVX2 + FMA, a failed build, MTPLM_FEWROW=0), with one
stderr line naming the fallback (the prepacked oneDNN path, kernels.py, which the lossless modes refuse, or
PyTorch's plain bf16 linear where oneDNN has no bf16 kernel either).
`mtplm setup` builds it; otherwise the first use does, and says how long it took.

Shapes: N rows, K in features, M out features, Kp = K rounded up to 32.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from torch import nn

from mtplm.files import home

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
BUILDS = {  # a build for each kind of x86 CPU: its compiler flags, the CPU flags it needs, its sources
    "avx512": (
        ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp"],
        {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"},
        "fewrow fewrow_avx512 fewrow_amx fewrow_avx2 lora int4 attend attend_avx512 attend_amx attend_avx2 "
        "head head_avx512 head_avx2 norm quant quant_avx512 quant_avx2",
    ),
    "avx2": (
        ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
        {"avx2", "fma", "f16c"},
        "fewrow fewrow_avx2 lora attend attend_avx2 head head_avx2 norm quant quant_avx2",
    ),
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo, read once; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def build_kind() -> str | None:
    """Which build this CPU runs: "avx512" (avx512_bf16), "avx2" (AVX2, FMA and F16C, or
    MTPLM_FEWROW_ISA=avx2: what such a CPU builds), or None (neither: ARM, older x86)."""
    flags = cpu_flags()
    forced = os.environ.get("MTPLM_FEWROW_ISA") == "avx2"
    for kind in ("avx512", "avx2"):
        if BUILDS[kind][1] <= flags and not (forced and kind == "avx512"):
            return kind
    return None


def unavailable() -> str | None:
    """Why the kernel cannot be built or run here, or None."""
    if os.environ.get("MTPLM_FEWROW", "1") == "0":
        return "MTPLM_FEWROW=0"
    if build_kind() is None:
        return "this CPU has neither avx512_bf16 nor AVX2 with FMA"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH"
    return None


def _build() -> tuple[list[str], list[Path]]:
    """This CPU's build: its compiler flags and source files."""
    flags, _, names = BUILDS[build_kind() or "avx2"]
    return flags, [CSRC / f"{name}.cpp" for name in names.split()]


def build_dir() -> Path:
    """Where this source, torch version and flag set build: a new hash builds afresh."""
    flags, _ = _build()
    files = sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")])  # headers too
    sources = b"".join(source.read_bytes() for source in files)
    key = hashlib.sha256(sources + torch.__version__.encode() + " ".join(flags).encode())
    root = os.environ.get("MTPLM_KERNELS_DIR") or home() / "kernels"
    return Path(root) / f"fewrow-{build_kind()}-{key.hexdigest()[:12]}"


@functools.cache
def load() -> bool:
    """Build (once per source and torch version) and load the kernel; False with one stderr line if it
    cannot be used here."""
    reason = unavailable()
    if reason is None:
        try:
            _build_and_load()
            return True
        except Exception as exc:  # noqa: BLE001 - any build or load failure means the fallback, said once
            reason = f"its build failed ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:160]})"
    log.warning(f"mtplm: few-row bf16 kernel not used: {reason}; {fallback()}")
    return False


def onednn_bf16_supported() -> bool:
    """oneDNN's bf16 products run here (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; not an AVX2-only CPU)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def fallback() -> str:
    """What bf16 linears use where this kernel does not load, in words."""
    if onednn_bf16_supported():
        return "using oneDNN's prepacked kernel"
    return "this CPU has no oneDNN bf16 kernel either: bf16 linears use PyTorch's plain kernel"


def _build_and_load() -> None:
    from torch.utils import cpp_extension  # slow to import; only where the kernel is used

    _ninja_on_path()
    flags, sources = _build()
    directory = build_dir()
    built = (directory / "mtplm_fewrow.so").exists()
    directory.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    cpp_extension.load(
        name="mtplm_fewrow",
        sources=[str(source) for source in sources],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )
    if not built:
        log.info(
            f"mtplm: built the few-row bf16 kernels ({build_kind()}) in "
            f"{time.perf_counter() - began:.1f} s ({directory})"
        )
    torch.library.register_fake("mtplm_fewrow::linear", linear_shape)
    torch.library.register_fake("mtplm_fewrow::pack", _pack_shape)
    torch.library.register_fake("mtplm_fewrow::lora_linear", _lora_shape)
    torch.library.register_fake("mtplm_fewrow::lora_delta", _lora_shape)
    if has_int4():
        torch.library.register_fake("mtplm_fewrow::int4_linear", _int4_linear_shape)
    torch.library.register_fake("mtplm_fewrow::attend", _attend_shape)
    torch.library.register_fake("mtplm_fewrow::mean_square", _mean_square_shape)


def _ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the PyPI package's binary sits beside the interpreter, which an
    unactivated virtualenv does not put on PATH."""
    if shutil.which("ninja") is None:
        directory = str(Path(sys.executable).parent)
        os.environ["PATH"] = directory + os.pathsep + os.environ.get("PATH", "")


def linear_shape(inputs: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The [N, M] result of a packed product, for tracing (this op's and kernels.py's oneDNN op's)."""
    return inputs.new_empty(inputs.shape[0], packed.shape[0])


def _int4_linear_shape(
    inputs: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return inputs.new_empty(inputs.shape[0], codes.shape[0])


def _lora_shape(inputs: torch.Tensor, packed: torch.Tensor, *rest: object) -> torch.Tensor:
    """The [N, M] result of lora_linear or lora_delta (inputs [N, K], packed [M, 1, Kw]), for tracing."""
    return inputs.new_empty(inputs.shape[0], packed.shape[0])


def _mean_square_shape(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], 1)


def _attend_shape(query, key_store, value_store, slots, mask, scaling) -> torch.Tensor:
    b, q, heads, d = query.shape
    return query.new_empty(b, q, heads * d)


def _pack_shape(weight: torch.Tensor) -> torch.Tensor:
    m, k = weight.shape
    return weight.new_empty(m, 1, -(-k // 32) * 32)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [M, K] bf16 -> the kernel's layout, an opaque [M, 1, Kp] tensor (load() must be True)."""
    return torch.ops.mtplm_fewrow.pack(weight.detach().contiguous())


def unpack(packed: torch.Tensor, k: int) -> torch.Tensor:
    """pack(W) -> W [M, k], a copy (packing is exact)."""
    m, _, kp = packed.shape
    mp = -(-m // 16) * 16
    blocked = packed.as_strided((mp // 16, kp // 2, 16, 2), (kp * 16, 32, 2, 1))
    return blocked.permute(0, 2, 1, 3).reshape(mp, kp)[:m, :k].contiguous()


def rows(packed: torch.Tensor, begin: int, end: int) -> torch.Tensor:
    """Outputs [begin, end) of pack(W) as a packed weight of their own over the same memory (`begin` a
    multiple of 16; the kernel may read, never write, the rows after `end` up to the next 16)."""
    if begin % 16:
        raise ValueError(f"a packed weight splits at multiples of 16 outputs, not at {begin}")
    kp = packed.shape[2]
    return packed.as_strided((end - begin, 1, kp), (kp, kp, 1), packed.storage_offset() + begin * kp)


class PackedLinear(nn.Module):
    """A Hugging Face Linear over a weight in pack()'s layout that the compiled pass reads too, so the model
    holds one copy: the forward runs `linear`; `.weight` and state_dict() give an unpacked copy."""

    packed: torch.Tensor  # a buffer, declared for type checkers

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, in_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, packed.shape[0]
        self.register_buffer("packed", packed, persistent=False)
        self.bias = bias  # the module's own Parameter (or None), as before

    @property
    def weight(self) -> torch.Tensor:
        return unpack(self.packed, self.in_features)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        flat = inputs.reshape(-1, self.in_features)
        return linear(flat, self.packed, self.bias).reshape(*inputs.shape[:-1], self.out_features)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()


def isa() -> str:
    """Which kernels run here: "amx" (AMX tiles), "avx512" (vdpbf16ps; MTPLM_FEWROW_ISA=avx512 keeps to it on
    a CPU with AMX) or "avx2" (AVX2 + FMA in float32: a CPU without avx512_bf16, or MTPLM_FEWROW_ISA=avx2)."""
    return torch.ops.mtplm_fewrow.isa()


def use_isa(name: str) -> str:
    """Run the kernels with "avx2", "avx512", "amx" (each the next one down where this build or CPU lacks it)
    or "auto"; the one now in use. The AVX-512 build's "avx2" gives an AVX2 CPU's bits."""
    return torch.ops.mtplm_fewrow.use_isa(name)


def has_int4() -> bool:
    """Whether the loaded build has the int4 kernel (the AVX-512 build's; elsewhere int4 runs on torch's)."""
    return build_kind() == "avx512"


def linear(inputs: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """inputs [N, K] @ W^T (+ bias) -> [N, M] over pack(W)."""
    return torch.ops.mtplm_fewrow.linear(inputs, packed, bias)


def lora_linear(
    inputs: torch.Tensor,
    packed: torch.Tensor,
    down_packed: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor | None,
    parts: list[int] | None = None,
) -> torch.Tensor:
    """inputs @ W^T + bf16(gate * inputs @ A_p^T) @ B_p^T (+ bias) -> [N, M] for the outputs of each part p,
    one call over packed = pack(widened_weight(W, [B_p])) (an output reads its own part's adapter columns
    only): inputs [N, K] bf16, down_packed = pack(A) of the parts' stacked A [R, K] bf16, gate [N] float32,
    parts: each part's out features (None: one part). The low-rank activations are rounded to bf16 before
    the product, as forward._project_widened's graph rounds them. Any number of rows: inputs @ A^T in AMX
    tiles for up to 32 rows on a CPU with AMX, else AVX-512 dot products."""
    return torch.ops.mtplm_fewrow.lora_linear(inputs, packed, down_packed, gate, bias, parts or [])


def lora_delta(
    inputs: torch.Tensor,
    packed: torch.Tensor,
    down_packed: torch.Tensor,
    gate: torch.Tensor,
    parts: list[int] | None = None,
) -> torch.Tensor:
    """bf16(gate * inputs @ A_p^T) @ B_p^T -> [N, M], the gated adapters' delta alone, one call, for a product
    they cannot widen (a GGUF's blocks): packed = pack(B_c), B_c = widened_weight(W[:, :0], [B_p])'s (each
    output reads its own part's r columns, not a block-diagonal's zeros); the other arguments as
    lora_linear's. Bitwise lora_linear over a W of zeros; every gate 0 gives zeros."""
    return torch.ops.mtplm_fewrow.lora_delta(inputs, packed, down_packed, gate, parts or [])


def widened_weight(weight: torch.Tensor, ups: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """([W | 0 | B_c] [M, Kp + r], each part's out features) for lora_linear, from the fused weight W [M, K]
    and the parts' B [out_p, r] (sum out_p = M): zeros to Kp = K rounded up to 32, then B_c, the parts' B
    stacked by rows. Every part but the last needs out features a multiple of 16 (else an output block
    would read two parts' columns), and every part the same rank."""
    parts = [up.shape[0] for up in ups]
    if any(rows % 16 for rows in parts[:-1]) or len({up.shape[1] for up in ups}) > 1:
        raise ValueError(f"lora_linear's parts need out features a multiple of 16 and one rank: {parts}")
    padding = weight.new_zeros(weight.shape[0], -weight.shape[1] % 32)
    return torch.cat([weight, padding, torch.cat(ups).to(weight.dtype)], dim=1), parts


def attend(
    query: torch.Tensor,
    key_store: torch.Tensor,
    value_store: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """forward.attend over query [b, Q, H, d] and stores [S, KVH, C, d] (both bf16 or both float32; d 64 or
    128) with an additive float32 mask [b, 1, 1, Q, T] -> [b, Q, H d]: every sum in one order fixed by the
    row and the keys it reads (csrc/attend.cpp), so a row's result does not depend on the rows beside it or
    on T."""
    return torch.ops.mtplm_fewrow.attend(query, key_store, value_store, slots, mask, scaling)
