"""The compiled backends the registry names: StaticBackend (backend.py) compiled or not, over bf16, int8 or
int4 projections."""

from __future__ import annotations

from mtplm.decode.fast.backend import StaticBackend
from mtplm.decode.passes.backends import require_compiler
from mtplm.model import MTPModel
from mtplm.registry import BACKENDS


@BACKENDS.register(
    "compiled",
    "our own pass for Llama, Qwen2 and Mistral over a static KV store, compiled "
    "per row bucket (torch.compile)",
)
class CompiledBackend(StaticBackend):
    def __init__(self, model: MTPModel, slots: int = 1) -> None:
        require_compiler()
        super().__init__(model, slots, compile=True)


@BACKENDS.register(
    "compiled-int8",
    "the compiled pass over weight-only int8 projections (per-channel scales; "
    "LM head and embeddings unquantized): a different model, measure its quality",
)
class CompiledInt8Backend(StaticBackend):
    def __init__(self, model: MTPModel, slots: int = 1) -> None:
        require_compiler()
        super().__init__(model, slots, compile=True, quantize=True)


@BACKENDS.register(
    "compiled-int4",
    "the compiled pass over group-wise int4 projections (32 weights per scale and "
    "zero, llama.cpp's Q4_1 scheme; LM head and embeddings unquantized): a "
    "different model, measure its quality",
)
class CompiledInt4Backend(StaticBackend):
    def __init__(self, model: MTPModel, slots: int = 1) -> None:
        require_compiler()
        super().__init__(model, slots, compile=True, quantize="int4")


@BACKENDS.register("static", "the same pass and store, not compiled (no compiler needed)")
class UncompiledBackend(StaticBackend):
    def __init__(self, model: MTPModel, slots: int = 1) -> None:
        super().__init__(model, slots, compile=False)
