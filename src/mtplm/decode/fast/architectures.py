"""The model families the fast pass runs, as one table: a Llama-shaped family (RMSNorm, rotary positions with
a static inverse-frequency table, grouped-query attention, a SiLU-gated MLP, optional projection biases) is
one `Architecture` entry of ARCHITECTURES, keyed by its Hugging Face class name, saying where a decoder
layer keeps its tensors and what tells the family apart. `check_supported` reads a model's Shape (the
numbers the pass needs) and refuses anything else with a UserError naming it: the eager Hugging Face path
(passes/ragged.py) stays the reference and the fallback.

Shapes: D hidden, H query heads, KVH key/value heads, d head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mtplm.errors import UserError
from mtplm.model import MTPModel

STATIC_ROPE = (
    "default",
    "linear",
    "llama3",
    "yarn",
)  # inv_freq fixed at load time; "dynamic" rescales per pass
# the groups the pass reads a layer's projections in (fused: one GEMM a group), each its parts' paths inside a
# decoder layer, in the order their outputs are stacked (forward.py splits q, k, v and gate, up by it)
LLAMA_PROJECTIONS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


@dataclass(frozen=True)
class Architecture:
    """Where a Llama-shaped family's decoder layer keeps its tensors, and what sets the family apart."""

    projections: dict[str, tuple[str, ...]] = field(default_factory=lambda: LLAMA_PROJECTIONS)
    norms: tuple[str, str] = (
        "input_layernorm",
        "post_attention_layernorm",
    )  # before attention, before the MLP
    attention: str = "self_attn"  # the module whose head_dim and scaling the Shape reads
    # a config flag that must be true for the config's sliding_window to apply (None: it applies as declared)
    window_flag: str | None = None


ARCHITECTURES = {
    "LlamaForCausalLM": Architecture(),
    "Qwen2ForCausalLM": Architecture(window_flag="use_sliding_window"),  # q, k, v biased
    "MistralForCausalLM": Architecture(),  # v0.1 declares a sliding window
}


@dataclass(frozen=True)
class Shape:
    """The architecture numbers the forward needs (from the HF config and modules)."""

    layers: int
    hidden: int  # D
    heads: int  # H
    kv_heads: int  # KVH
    head_dim: int  # d
    eps: float  # RMSNorm epsilon
    scaling: float  # attention score scale (HF's module.scaling)
    rope_scaling: float  # multiplies cos and sin (HF's attention_scaling: 1 except yarn-like types)
    gated: bool  # gated LoRA adapters present
    lora_scale: float  # alpha / rank
    mask_id: int  # the <mtp> id (-1: none, the gate never opens)


def architecture(model: MTPModel) -> Architecture:
    """The model's ARCHITECTURES entry; a UserError naming the supported ones where it has none."""
    name = type(model.hf).__name__
    if name not in ARCHITECTURES:
        raise UserError(
            f"the compiled backend runs {', '.join(ARCHITECTURES)}; this model is {name}: use --backend eager"
        )
    return ARCHITECTURES[name]


def unsupported(model: MTPModel) -> str | None:
    """Why the fast pass cannot run `model` (None: it can)."""
    try:
        check_supported(model)
    except UserError as exc:
        return str(exc)
    return None


def check_supported(model: MTPModel) -> Shape:
    """The Shape of a model the fast pass can run; UserError naming what is not supported otherwise."""
    hf = model.hf
    name = type(hf).__name__
    if model.feature_layers:
        raise UserError(
            "the compiled backend returns final hidden states only; an EAGLE-3 drafter reads inner "
            "layers too: use --backend eager"
        )
    family = architecture(model)
    config = hf.config
    rotary = hf.get_decoder().rotary_emb
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type not in STATIC_ROPE:
        raise UserError(
            f"the compiled backend needs a static RoPE table; {name} uses rope type "
            f"{rope_type!r}: use --backend eager"
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UserError(
            f"the compiled backend runs SiLU MLPs; {name} uses {config.hidden_act!r}: use --backend eager"
        )
    attn = getattr(hf.get_decoder().layers[0], family.attention)
    gate = model.gate
    return Shape(
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=attn.head_dim,
        eps=float(config.rms_norm_eps),
        scaling=float(attn.scaling),
        rope_scaling=float(getattr(rotary, "attention_scaling", 1.0)),
        gated=gate is not None,
        lora_scale=float(gate.scale) if gate is not None else 0.0,
        mask_id=model.meta.mask_id if model.meta is not None and model.meta.mask_id is not None else -1,
    )


def sliding_window(model: MTPModel) -> int | None:
    """The attention window if any layer uses one (Mistral v0.1, Qwen2 with use_sliding_window)."""
    config = model.hf.config
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if window is None or (types is not None and "sliding_attention" not in types):
        return None
    flag = architecture(model).window_flag
    if flag is not None and not getattr(config, flag, False):
        return None
    return int(window)
