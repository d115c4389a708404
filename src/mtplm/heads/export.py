"""Export trained medusa-form heads in vLLM's Medusa draft-model layout (`--speculative-config` method
"medusa"), and read that layout back.

The folder holds `config.json` (model_type "medusa": hidden_size, vocab_size, num_heads,
num_hidden_layers = 1, medusa_fc_bias, original_lm_head) and `model.safetensors` with
`blocks.{i}.layers.0.weight|bias` for Medusa head i (our head i + 2, token t+i+2) and
`lm_heads.0.weight`, the base model's own LM head, which every head shares (`original_lm_head`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mtplm.errors import UserError
from mtplm.files import atomic_dir
from mtplm.heads.forms import Heads
from mtplm.model import load_model

WEIGHTS = "model.safetensors"


def export_medusa(checkpoint: str, out: str | os.PathLike) -> Path:
    model = load_model(checkpoint, "fp32")
    if model.heads is None or model.heads.form != "medusa":
        raise UserError(f"{checkpoint} has no medusa-form heads: train them with `mtplm train method=heads "
                        "head_form=medusa` (sequential heads have no Medusa equivalent)")
    lm = model.hf.get_output_embeddings().weight
    tensors = {"lm_heads.0.weight": lm.detach().float().contiguous()}
    for i, block in enumerate(model.heads.blocks):
        tensors[f"blocks.{i}.layers.0.weight"] = block.linear.weight.detach().float().contiguous()
        tensors[f"blocks.{i}.layers.0.bias"] = block.linear.bias.detach().float().contiguous()
    config = {
        "architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": int(lm.shape[1]),
        "vocab_size": int(lm.shape[0]), "truncated_vocab_size": int(lm.shape[0]),
        "num_heads": len(model.heads.blocks), "num_hidden_layers": 1, "max_paths": 64, "topk": 10,
        "medusa_fc_bias": True, "original_lm_head": True,
        "base_model_name_or_path": model.meta.base_model.get("spec", ""),
    }

    def write(tmp: Path) -> None:
        save_file(tensors, tmp / WEIGHTS)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    return atomic_dir(Path(out), write)


def load_medusa(directory: str | os.PathLike) -> tuple[Heads, torch.Tensor]:
    """Heads and the shared LM head weight [V, D] from a folder in vLLM's Medusa layout."""
    directory = Path(directory)
    try:
        config = json.loads((directory / "config.json").read_text())
        tensors = load_file(directory / WEIGHTS)
    except (OSError, ValueError) as exc:
        raise UserError(f"{directory} is not a Medusa export (config.json + {WEIGHTS}): {exc}") from None
    if config.get("model_type") != "medusa" or config.get("num_hidden_layers") != 1:
        raise UserError(f"{directory}: only single-layer Medusa heads (model_type medusa) can be read")
    heads = Heads("medusa", config["num_heads"] + 1, config["hidden_size"])
    state = {f"blocks.{i}.linear.{kind}": tensors[f"blocks.{i}.layers.0.{kind}"]
             for i in range(config["num_heads"]) for kind in ("weight", "bias")}
    heads.load_state_dict(state)
    return heads, tensors["lm_heads.0.weight"]
