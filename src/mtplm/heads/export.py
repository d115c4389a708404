"""Exports of trained heads into formats that serving engines load, and readers of them.

medusa  vLLM's Medusa draft-model layout (`--speculative-config` method "medusa"): `config.json` (model_type
        "medusa": hidden_size, vocab_size, num_heads, num_hidden_layers = 1, medusa_fc_bias, original_lm_head)
        and `model.safetensors` with `blocks.{i}.layers.0.weight|bias` for Medusa head i (our head i + 2,
        token t+i+2) and `lm_heads.0.weight`, the base model's own LM head, which every head shares.
eagle3  the speculators format (Eagle3Speculator, speculators 0.9): what vLLM loads with method "eagle3" and
        llama.cpp's convert_hf_to_gguf.py turns into a draft-eagle3 GGUF (with --target-model-dir).
        `config.json` holds speculators_model_type "eagle3", speculators_config (greedy proposals of K-1
        tokens, the verifier), transformer_layer_config (a one-layer Llama config: sizes, heads, rope, eps),
        draft_vocab_size, target_hidden_size, eagle_aux_hidden_state_layer_ids and the norm flags (all false:
        vLLM's default for a missing norm_before_residual is true); `model.safetensors` holds the drafter's
        state dict under speculators' names (fc.weight, layers.0.*, norm.weight, lm_head.weight) plus, for a
        draft vocabulary smaller than the target's (and always on the way to gguf-eagle3), d2t (int64
        offsets: target id = i + d2t[i]) and t2d (bool over the target vocabulary). The token embedding is
        the target's (not written; vLLM and llama.cpp then share the target's).
pard    a converted `<mtp>` model as a parallel draft model (vLLM's method "draft_model" with
        parallel_drafting, after PARD): an ordinary HF model directory, the gated adapters merged into the
        base weights (so they act on every row, not only on `<mtp>` rows: no engine has gated adapters), its
        tokenizer, and in `config.json` the `<mtp>` id as `pard_token` (a mask-token field vLLM reads) and an
        "mtplm" record: the mask token, k_max and the speculative config to give vLLM (k_max draft tokens:
        the pending token's row drafts one, its k_max - 1 `<mtp>` slots the rest, as in mtplm).
gguf-eagle3  that export converted by the installed llama.cpp (mtplm.llamacpp) into the one-file draft model
        llama-server runs with `--spec-type draft-eagle3` (f16 weights; the target's tokenizer, layer ids and
        hidden size recorded from --target-model-dir, which must match the drafter).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mtplm import lora
from mtplm.assets.models import base_model_dir
from mtplm.errors import UserError
from mtplm.files import atomic_dir
from mtplm.heads.eagle3 import Eagle3Drafter
from mtplm.heads.forms import Heads
from mtplm.llamacpp import convert, converter
from mtplm.model import MTPMeta, load_model
from mtplm.modelio import MASK_TOKEN, checkpoint_dir, read_meta

WEIGHTS = "model.safetensors"
log = logging.getLogger(__name__)


def export_medusa(checkpoint: str, out: str | os.PathLike) -> Path:
    model = load_model(checkpoint, "fp32")
    if model.heads is None or model.heads.form != "medusa":
        raise UserError(
            f"{checkpoint} has no medusa-form heads: train them with `mtplm train method=heads "
            "head_form=medusa` (sequential heads have no Medusa equivalent)"
        )
    lm = model.hf.get_output_embeddings().weight
    tensors = {"lm_heads.0.weight": lm.detach().float().contiguous()}
    for i, block in enumerate(model.heads.blocks):
        tensors[f"blocks.{i}.layers.0.weight"] = block.linear.weight.detach().float().contiguous()
        tensors[f"blocks.{i}.layers.0.bias"] = block.linear.bias.detach().float().contiguous()
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": int(lm.shape[1]),
        "vocab_size": int(lm.shape[0]),
        "truncated_vocab_size": int(lm.shape[0]),
        "num_heads": len(model.heads.blocks),
        "num_hidden_layers": 1,
        "max_paths": 64,
        "topk": 10,
        "medusa_fc_bias": True,
        "original_lm_head": True,
        "base_model_name_or_path": model.meta.base_model.get("spec", "") if model.meta else "",
    }

    def write(tmp: Path) -> None:
        save_file(tensors, tmp / WEIGHTS)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    return atomic_dir(Path(out), write)


def _read_export(directory: Path, kind: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and the safetensors weights of an export folder; UserError naming `kind` otherwise."""
    try:
        return json.loads((directory / "config.json").read_text()), load_file(directory / WEIGHTS)
    except (OSError, ValueError) as exc:
        raise UserError(f"{directory} is not {kind} (config.json + {WEIGHTS}): {exc}") from None


def load_medusa(directory: str | os.PathLike) -> tuple[Heads, torch.Tensor]:
    """Heads and the shared LM head weight [V, D] from a folder in vLLM's Medusa layout."""
    directory = Path(directory)
    config, tensors = _read_export(directory, "a Medusa export")
    if config.get("model_type") != "medusa" or config.get("num_hidden_layers") != 1:
        raise UserError(f"{directory}: only single-layer Medusa heads (model_type medusa) can be read")
    heads = Heads("medusa", config["num_heads"] + 1, config["hidden_size"])
    state = {
        f"blocks.{i}.linear.{kind}": tensors[f"blocks.{i}.layers.0.{kind}"]
        for i in range(config["num_heads"])
        for kind in ("weight", "bias")
    }
    heads.load_state_dict(state)
    return heads, tensors["lm_heads.0.weight"]


SPECULATORS_VERSION = "0.9.0"  # the speculators release whose Eagle3Speculator format this follows


def export_eagle3(
    checkpoint: str, out: str | os.PathLike, verifier: str | None = None, identity_mapping: bool = False
) -> Path:
    """Write an eagle3-form checkpoint in the speculators format (module docstring); `verifier` names the
    target for vLLM (an HF id or path; default: the checkpoint's base model spec). A draft vocabulary equal
    to the target's is written without d2t/t2d unless `identity_mapping`: vLLM creates no
    draft_id_to_target_id then and refuses to load one ("no module or parameter named ...")."""
    meta = eagle3_meta(checkpoint)
    model = load_model(checkpoint, "fp32")
    drafter = model.heads
    tensors = {name: value.detach().contiguous() for name, value in drafter.state_dict().items()}
    if drafter.settings["draft_vocab"] == drafter.settings["vocab"] and not identity_mapping:
        del tensors["d2t"], tensors["t2d"]
    config = speculators_config(
        drafter.config(),
        verifier or meta.base_model.get("spec", ""),
        list(getattr(model.hf.config, "architectures", None) or [type(model.hf).__name__]),
    )

    def write(tmp: Path) -> None:
        save_file(tensors, tmp / WEIGHTS)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    return atomic_dir(Path(out), write)


def eagle3_meta(checkpoint: str) -> MTPMeta:
    """The metadata of an eagle3-form checkpoint, or a UserError saying what the checkpoint is instead."""
    meta = read_meta(checkpoint_dir(checkpoint))
    if meta.method != "heads" or meta.heads.get("form") != "eagle3":
        form = meta.heads.get("form", "no heads") if meta.method == "heads" else f"a {meta.method} checkpoint"
        raise UserError(
            f"{checkpoint} is not an eagle3 drafter ({form}): train one with `mtplm train "
            "method=heads head_form=eagle3`"
        )
    return meta


def export_gguf_eagle3(
    checkpoint: str, out: str | os.PathLike, target_dir: str | os.PathLike | None = None
) -> Path:
    """A draft-eagle3 GGUF for llama-server (`--spec-type draft-eagle3 --model-draft OUT`): the speculators
    export, in a temporary folder, run through the installed llama.cpp converter with `--target-model-dir`
    (default: the HF directory the checkpoint was trained on), whose tokenizer and config it reads."""
    meta = eagle3_meta(checkpoint)
    target = (
        Path(target_dir) if target_dir else base_model_dir(meta.base_model) or Path(meta.base_model["spec"])
    )
    check_target(target, meta.heads)
    converter()  # before any work: a missing install is one line
    with tempfile.TemporaryDirectory(prefix="mtplm-eagle3-") as tmp:
        # the mapping as before for llama.cpp, whose converter reads it (identity or not) into the GGUF
        spec = export_eagle3(checkpoint, Path(tmp) / "speculators", identity_mapping=True)
        return convert(spec, Path(out), "--target-model-dir", str(target), "--outtype", "f16")


def check_target(target: Path, settings: dict) -> None:
    """UserError unless `target` is an HF model directory the drafter described by `settings` was built
    for."""
    try:
        config = json.loads((target / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"--target-model-dir {target}: no readable config.json ({exc})") from None
    config = {**config, **config.get("text_config", {})}
    wanted = {"hidden_size": settings["dim"], "vocab_size": settings["vocab"]}
    wrong = [
        f"{key} {config.get(key)} (the drafter's: {value})"
        for key, value in wanted.items()
        if config.get(key) != value
    ]
    if not wrong and int(config.get("num_hidden_layers", 0)) <= max(settings["layers"]):
        wrong = [
            f"num_hidden_layers {config.get('num_hidden_layers')} (the drafter reads layer "
            f"{max(settings['layers'])})"
        ]
    if wrong:
        raise UserError(f"--target-model-dir {target} does not match the drafter: {', '.join(wrong)}")


def speculators_config(settings: dict, verifier: str, architectures: list[str]) -> dict:
    """The config.json of an Eagle3Speculator for a drafter built from `settings` (Eagle3Drafter.config())."""
    theta = float(settings["rope_theta"])
    layer = {
        "model_type": "llama",
        "vocab_size": settings["vocab"],
        "hidden_size": settings["dim"],
        "intermediate_size": settings["intermediate"],
        "num_hidden_layers": 1,
        "num_attention_heads": settings["heads"],
        "num_key_value_heads": settings["kv_heads"],
        "head_dim": settings["head_dim"],
        "hidden_act": "silu",
        "rms_norm_eps": settings["eps"],
        "max_position_embeddings": settings["max_positions"],
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    proposal = {
        "proposal_type": "greedy",
        "speculative_tokens": settings["k"] - 1,
        "verifier_accept_k": 1,
        "accept_tolerance": 0.0,
    }
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [proposal],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": architectures},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": settings["draft_vocab"],
        "target_hidden_size": settings["dim"],
        "eagle_aux_hidden_state_layer_ids": list(settings["layers"]),
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "torch_dtype": "float32",
    }


def load_eagle3(directory: str | os.PathLike) -> tuple[Eagle3Drafter, dict]:
    """An Eagle3Drafter and the parsed config.json from a speculators-format folder (ours or another plain
    one: a single Llama layer, no extra norms, no own embedding)."""
    directory = Path(directory)
    config, tensors = _read_export(directory, "a speculators export")
    layer = config.get("transformer_layer_config") or {}
    if config.get("speculators_model_type") != "eagle3" or layer.get("num_hidden_layers") != 1:
        raise UserError(f"{directory}: only single-layer speculators eagle3 drafters can be read")
    flags = [
        flag
        for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
        if config.get(flag)
    ]
    if flags or layer.get("attention_bias") or layer.get("mlp_bias"):
        raise UserError(
            f"{directory}: {', '.join(flags) or 'biases'} not supported by mtplm's eagle3 drafter"
        )
    rope = layer.get("rope_parameters") or {}
    heads = layer["num_attention_heads"]
    drafter = Eagle3Drafter(
        k=config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] + 1,
        dim=layer["hidden_size"],
        intermediate=layer["intermediate_size"],
        heads=heads,
        kv_heads=layer.get("num_key_value_heads", heads),
        head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
        eps=layer["rms_norm_eps"],
        rope_theta=rope.get("rope_theta", layer.get("rope_theta", 10000.0)),
        layers=config["eagle_aux_hidden_state_layer_ids"],
        vocab=layer["vocab_size"],
        draft_vocab=config["draft_vocab_size"],
        max_positions=layer.get("max_position_embeddings", 8192),
    )
    if (
        "d2t" not in tensors and drafter.settings["draft_vocab"] == drafter.settings["vocab"]
    ):  # no reduced vocabulary
        tensors.update(d2t=drafter.d2t.clone(), t2d=drafter.t2d.clone())
    try:
        drafter.load_state_dict(tensors)
    except RuntimeError as exc:
        raise UserError(
            f"{directory / WEIGHTS} does not hold the drafter its config.json describes: {exc}"
        ) from None
    return drafter.eval(), config


def export_pard(checkpoint: str, out: str | os.PathLike, target_dir: str | os.PathLike | None = None) -> Path:
    """A converted `<mtp>` checkpoint as a parallel draft model for vLLM (module docstring), checked against
    the target it will draft for (`target_dir`, default: the base model it was converted from): the same
    tokenizer, `<mtp>` aside."""
    path = checkpoint_dir(checkpoint)
    meta = read_meta(path)
    if meta.method != "mask" or meta.mask_id is None:
        raise UserError(
            f"{checkpoint} is a {meta.method} checkpoint with no <mtp> token: a parallel draft model is a "
            "converted model (`mtplm train`, method mask)"
        )
    base = base_model_dir(meta.base_model)
    target = Path(target_dir) if target_dir else base
    if target is None:
        raise UserError(
            f"{checkpoint}: its base model {meta.base_model.get('name', '')} is not on this machine: name"
            " the target with --target-model-dir"
        )
    # a full checkpoint carries its tokenizer; a delta one is its base's plus <mtp>
    vocab = check_pard_target(target, path if (path / "tokenizer_config.json").is_file() else base or target)
    model = load_model(checkpoint, "fp32")
    rows = model.hf.get_input_embeddings().weight.shape[0]
    if vocab > rows:
        raise UserError(
            f"--target-model-dir {target}: vocab_size {vocab}, more than the drafter's {rows} rows"
        )
    spec = {"method": "draft_model", "num_speculative_tokens": meta.k_max, "parallel_drafting": True}
    if vocab != rows:  # `<mtp>` took a row of its own: vLLM then maps the two vocabularies by token
        spec["use_heterogeneous_vocab"] = True
    if model.gate is not None:
        log.warning(
            "%s: its gated adapters are merged into every row, so the drafter's own next-token rows change "
            "too and it drafts poorly (docs/vllm.md); for a parallel drafter, convert with trainable=lora "
            "ntp_weight=1",
            checkpoint,
        )
        merge_gated_adapters(model.hf)

    def write(tmp: Path) -> None:
        with lora.unwrapped(model.hf):
            model.hf.save_pretrained(tmp)
        model.tokenizer.save_pretrained(tmp)
        config = json.loads((tmp / "config.json").read_text())
        config["pard_token"] = meta.mask_id
        config["mtplm"] = {"mask_token": MASK_TOKEN, "k_max": meta.k_max, "vllm_speculative_config": spec}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    return atomic_dir(Path(out), write)


def merge_gated_adapters(hf: torch.nn.Module) -> None:
    """W += scale * B A in every gated-LoRA layer, in place: the adapters then act on every row (the layer
    must be unwrapped, `lora.unwrapped`, or they would act twice at mask rows)."""
    with torch.no_grad():
        for module in hf.modules():
            if isinstance(module, lora.GatedLoRALinear):
                delta = module.lora_b.float() @ module.lora_a.float() * module.gate.scale  # [out, in]
                module.base.weight += delta.to(module.base.weight.dtype)


def check_pard_target(target: Path, drafter_tokenizer: Path) -> int:
    """UserError unless the HF directory `target` has the tokenizer in `drafter_tokenizer` (`<mtp>` aside);
    the target's vocab_size."""
    from transformers import AutoTokenizer

    try:
        config = json.loads((target / "config.json").read_text())
        theirs = AutoTokenizer.from_pretrained(target).get_vocab()
        ours = AutoTokenizer.from_pretrained(drafter_tokenizer).get_vocab()
    except (OSError, ValueError) as exc:
        raise UserError(
            f"--target-model-dir {target}: no readable config.json and tokenizer ({exc})"
        ) from None
    ours.pop(MASK_TOKEN, None)
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda item: item[1])
        raise UserError(
            f"--target-model-dir {target}: its tokenizer is not the drafter's ({len(theirs)} tokens against "
            f"{len(ours)}, {len(differ)} entries differ, e.g. {differ[:2]}): a parallel drafter needs its "
            "target's tokenizer"
        )
    return int({**config, **config.get("text_config", {})}.get("vocab_size", 0))
