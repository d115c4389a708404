"""A converted GGUF model's quantized linear weights as the GGUF holds them, and its model without them.

Conversion (models.py) dequantizes a GGUF once into a float32 Hugging Face directory and records the GGUF
in its mtplm_source.json. Run quantized (`--dtype gguf`, or `auto` where every block type is supported),
a model is built from both: config, tokenizer, norms and biases from the converted directory, the
embedding read from the GGUF row by row (assets/embedding.py), and every linear weight (q, k, v, o, gate,
up, down and the LM head, tied or not) left as the GGUF's own blocks, read from the file (its tensor table
from the header alone: gguf_tensors.py) only when the fast backend packs them (decode/fast/gguf.py). The
Hugging Face model's linear weights are never materialized: they sit on the meta device, so its own
forward cannot run (the eager backend refuses such a model).

llama.cpp's converter permutes the rows of attn_q and attn_k for the llama architecture (its RoPE pairs
adjacent dimensions; Hugging Face's pairs halves); `GGUFLinear.raw` undoes it on whole rows of blocks, as
transformers' GGUF loader (modeling_gguf_pytorch_utils.LlamaTensorProcessor) does on floats.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mtplm.assets.embedding import GGUFEmbedding, read_into
from mtplm.assets.gguf_tensors import read_header
from mtplm.assets.models import MODELS, SOURCE_FILE, locate_gguf
from mtplm.errors import UserError

log = logging.getLogger(__name__)
# the block types mtplm.decode.fast.quant runs (its BLOCK_TYPES; a test checks that it runs all of these)
SUPPORTED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K")
# Hugging Face's module names of a layer's linears, by the GGUF tensor name's part
LINEARS = {
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}
PERMUTED = ("llama",)  # architectures whose attn_q / attn_k rows llama.cpp's converter permutes


class UnsupportedWeights(UserError):
    """A GGUF whose linear tensors mtplm cannot run as they are (a block type without a kernel, a tensor
    missing or of another shape): the model's files, not the machine, are at fault (the server: a 400)."""


@dataclass(frozen=True)
class GGUFLinear:
    """One linear weight [out_features, in_features] as the GGUF stores it."""

    name: str  # the GGUF's tensor name
    kind: str  # its block type name ("Q4_1", ...)
    out_features: int
    in_features: int
    path: Path
    offset: int  # where its data begins in the file
    row_bytes: int
    heads: int = 0  # > 0: rows permuted by llama.cpp over this many heads (undone by `raw`)

    def raw(self) -> torch.Tensor:
        """Its bytes, uint8 [out_features, row_bytes], in Hugging Face's row order (read from the file)."""
        return self.rows(0, self.out_features)

    def rows(self, start: int, count: int) -> torch.Tensor:
        """Rows [start, start + count) of its bytes in Hugging Face's order, uint8 [count, row_bytes], read
        from the file into one new tensor (a permuted tensor: its whole bytes read, then those rows)."""
        if not self.heads:
            out = np.empty((count, self.row_bytes), dtype=np.uint8)
            return torch.from_numpy(read_into(self.path, self.offset + start * self.row_bytes, out))
        whole = np.empty((self.out_features, self.row_bytes), dtype=np.uint8)
        rows = torch.from_numpy(read_into(self.path, self.offset, whole))
        # transformers' _reverse_permute_weights on rows: [h, 2, d/2] -> [h, d/2, 2]
        half = self.out_features // self.heads // 2
        rows = rows.view(self.heads, half, 2, self.row_bytes).transpose(1, 2)
        return rows.reshape(self.out_features, self.row_bytes)[start : start + count].clone()


@dataclass
class GGUFWeights:
    """A GGUF's linear weights: `layers[i]` by Hugging Face module name (q_proj, ...), and the LM head."""

    path: Path
    layers: list[dict[str, GGUFLinear]]
    head: GGUFLinear  # output.weight, or token_embd.weight where the head is tied to the embedding
    embedding: GGUFLinear | None = None  # token_embd.weight, read row by row (assets/embedding.py)

    def linears(self) -> list[GGUFLinear]:
        return [linear for layer in self.layers for linear in layer.values()] + [self.head]

    def unsupported(self, supported: tuple[str, ...] = SUPPORTED) -> str | None:
        """Why this GGUF cannot run quantized (its first linear tensor of another block type), else None."""
        for linear in self.linears():
            if linear.kind not in supported:
                return (
                    f"{self.path.name}: tensor {linear.name} is {linear.kind}; mtplm runs GGUF weights as "
                    f"they are in {', '.join(supported)} only"
                )
        return None

    def nbytes(self) -> int:
        return sum(linear.out_features * linear.row_bytes for linear in self.linears())


def gguf_source(directory: Path) -> Path | None:
    """The GGUF a converted directory was made from (mtplm_source.json), where it is still on this machine
    (a registry model's is installed again if it moved); None for any other directory."""
    try:
        source = json.loads((Path(directory) / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    path = Path(source.get("gguf") or "")
    if source.get("gguf") and path.is_file():
        return path
    entry = MODELS.get(source.get("name") or "")
    if entry is not None and source.get("sha256") == entry.sha256:
        return locate_gguf(entry)
    return None


def read_gguf_weights(path: Path, config: Any) -> GGUFWeights:
    """The linear weights of the GGUF at `path` for a model of Hugging Face `config` (UserError where one is
    missing or of another shape)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    header = read_header(path)
    arch, tensors = header.architecture, header.tensors
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}

    def linear(name: str, permute: int = 0) -> GGUFLinear:
        tensor = tensors.get(name)
        if tensor is None:
            raise UnsupportedWeights(
                f"{path.name} has no tensor {name}; it does not hold this model's weights"
            )
        in_features, out_features = tensor.shape[:2]
        block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[tensor.kind]]
        row_bytes = in_features // block * type_bytes
        return GGUFLinear(
            name, tensor.kind, out_features, in_features, path, tensor.data_offset, row_bytes, permute
        )

    layers = [
        {
            module: linear(f"blk.{i}.{part}.weight", heads.get(part, 0) if arch in PERMUTED else 0)
            for part, module in LINEARS.items()
        }
        for i in range(config.num_hidden_layers)
    ]
    head = linear("output.weight" if "output.weight" in tensors else "token_embd.weight")
    return GGUFWeights(path, layers, head, linear("token_embd.weight"))


def quantized_model(directory: Path, dtype: str) -> tuple[Any, Any, GGUFWeights] | None:
    """(the Hugging Face model of `directory` without its linear weights, its tokenizer, the GGUF's
    weights) where `dtype` asks
    for the GGUF's own blocks ("gguf", or "auto" where every linear tensor's type is supported); None where
    the model runs dequantized ("auto" says why once). UserError for "gguf" on a model without a GGUF or with
    an unsupported tensor type."""
    if dtype not in ("auto", "gguf"):
        return None
    from transformers import AutoConfig, AutoTokenizer

    source = gguf_source(directory)
    if source is None:
        if dtype == "gguf":
            raise UserError(f"--dtype gguf runs a GGUF's weights as they are; {directory} is not from a GGUF")
        return None
    config = AutoConfig.from_pretrained(directory)
    weights = read_gguf_weights(source, config)
    reason = weights.unsupported()
    if reason is not None:
        if dtype == "gguf":
            raise UnsupportedWeights(reason)
        log.info(f"[mtplm] {reason}: running it dequantized to bf16 (--dtype bf16)")
        return None
    return _without_linears(directory, config, weights), AutoTokenizer.from_pretrained(directory), weights


def _check_shape(linear: GGUFLinear, expected: tuple, what: str) -> None:
    if (linear.out_features, linear.in_features) != expected:
        raise UnsupportedWeights(
            f"{linear.path.name}: tensor {linear.name} is [{linear.out_features}, {linear.in_features}]; "
            f"this model's {what} is {list(expected)}: the GGUF does not hold this model's weights"
        )


def _without_linears(directory: Path, config: Any, weights: GGUFWeights) -> Any:
    """The Hugging Face model of `directory` in bf16, its linear weights on the meta device (never read):
    every other tensor read one at a time from its safetensors."""
    from safetensors import safe_open
    from transformers import GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    with torch.device("meta"):
        hf = model_class(config).to(torch.bfloat16)
    skipped = {"lm_head.weight"}  # tied: the embedding's; else never read (the GGUF's head runs)
    embedding = weights.embedding
    if embedding is not None:  # read from the GGUF on demand (assets/embedding.py), never loaded whole
        if embedding.in_features != config.hidden_size or embedding.out_features > config.vocab_size:
            _check_shape(embedding, (config.vocab_size, config.hidden_size), "the input embedding")
        skipped.add(_parameter_name(hf, hf.get_input_embeddings().weight))
    for i, layer in enumerate(weights.layers):
        for module, linear in layer.items():
            name = f"model.layers.{i}.{'self_attn' if module[0] in 'qkvo' else 'mlp'}.{module}"
            _check_shape(linear, tuple(hf.get_submodule(name).weight.shape), name)
            skipped.add(f"{name}.weight")
    head = weights.head
    if head.in_features != config.hidden_size or head.out_features > config.vocab_size:
        _check_shape(head, (config.vocab_size, config.hidden_size), "the LM head")
    state: dict[str, torch.Tensor] = {}
    extra = None  # the converted embedding's rows past the GGUF's, if any
    files = sorted(Path(directory).glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as stream:
            for name in stream.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name not in skipped:
                    state[name] = stream.get_tensor(name).to(torch.bfloat16)
                elif embedding is not None and name == _parameter_name(hf, hf.get_input_embeddings().weight):
                    extra = stream.get_slice(name)[embedding.out_features :].to(torch.bfloat16)
    hf.load_state_dict(state, strict=False, assign=True)
    if embedding is not None:
        hf.set_input_embeddings(GGUFEmbedding(embedding, config.vocab_size, torch.bfloat16, extra))
    if getattr(config, "tie_word_embeddings", False):
        hf.tie_weights()
    decoder = hf.get_decoder()
    decoder.rotary_emb = type(decoder.rotary_emb)(config=config)  # its inv_freq, computed on the CPU
    missing = [n for n, p in hf.named_parameters() if p.is_meta and n not in skipped and ".lora_" not in n]
    if missing:
        raise UserError(f"{directory} lacks {missing[0]} beside the GGUF's linear weights")
    hf.config.name_or_path = hf.name_or_path = str(directory)
    if (Path(directory) / "generation_config.json").is_file():
        hf.generation_config = GenerationConfig.from_pretrained(directory)
    return hf.eval()


def _parameter_name(module: Any, parameter: torch.Tensor) -> str:
    """`parameter`'s name in `module` ("model.embed_tokens.weight")."""
    return next(name for name, p in module.named_parameters() if p is parameter)
