"""The fast decode path: a compiled, static-shape forward pass for Llama-family models.

weights.py   what the pass reads from the HF model (fused projections, fused gated-LoRA adapters)
layers.py    one decoder layer's weights, typed: its norms and projections (products and adapters)
forward.py   the pass itself, pure functions over those weights and a static KV store
prefill.py   wide prompt passes (fused attention, the store read in place)
graphs.py    which functions compile, with which inductor options, and where the compile cache lives
kernels.py   the products: prepacked bf16, int8, int4; fewrow.py builds and loads mtplm's own C++ kernels
greedy.py    greedy tokens from an int8 copy of the LM head, exactly its argmax
backend.py   StaticBackend: the store, the buckets, compilation; a drop-in for RaggedCache + ragged_pass
variants.py  the backends the registry names (compiled, compiled-int8, compiled-int4, static)
"""

from mtplm.decode.fast.backend import StaticBackend

__all__ = ["StaticBackend"]
