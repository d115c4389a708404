"""The fast decode path: a compiled, static-shape forward pass for Llama-family models (issue 14).

weights.py  what the pass reads from the HF model (fused projections, fused gated-LoRA adapters)
forward.py  the pass itself, pure functions over those weights and a static KV store
backend.py  StaticBackend: the store, the buckets, compilation; a drop-in for RaggedCache + ragged_pass
"""

from mtplm.decode.fast.backend import StaticBackend

__all__ = ["StaticBackend"]
