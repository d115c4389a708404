"""Reading and writing converted checkpoints: metadata, full, delta and head-based forms, shipped names.

A converted checkpoint is an ordinary HF checkpoint (loads with `AutoModelForCausalLM.from_pretrained`)
with `mtplm.json` beside it; gated-LoRA adapters, which plain HF cannot express, sit in
`gated_lora.safetensors`. A *delta* checkpoint stores only what conversion added (the mask token's
rows and the adapters) and names its base model; it is what ships inside the package. A head-based
checkpoint holds the heads' weights and names its base model.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mtplm import lora
from mtplm.errors import UserError
from mtplm.files import atomic_dir
from mtplm.model import MASK_TOKEN, MTPMeta, MTPModel, parse_dtype

META_FILE = "mtplm.json"
ADAPTER_FILE = "gated_lora.safetensors"
HEADS_FILE = "heads.safetensors"
DELTA_FILE = "delta.safetensors"
SHIPPED = Path(__file__).parent / "checkpoints"
_LOADING = threading.RLock()  # load: one at a time (reentrant: a delta loads its base inside)


def load(spec: str | os.PathLike, dtype: str = "fp32") -> MTPModel:
    """A converted checkpoint (full, delta or heads), or a base model (plain decoding only).

    One load at a time per process: Hugging Face model construction changes process-wide state
    while it runs (torch's default dtype, patched torch functions), and two threads loading at once
    (a server loading two models) can restore each other's changes in the wrong order. A test run
    that did so left every model loaded afterwards with its weights on the meta device.
    """
    with _LOADING:
        return _load(spec, dtype)


def _load(spec: str | os.PathLike, dtype: str) -> MTPModel:
    from mtplm.assets.models import resolve_model

    path = Path(spec)
    if not (path / META_FILE).is_file():
        hf, tokenizer = _load_hf(resolve_model(str(spec)), dtype)
        return MTPModel(hf, tokenizer, None)
    meta = read_meta(path)
    if meta.method == "heads":
        return _load_heads(load(meta.base_model["spec"], dtype), path, meta)
    if meta.delta:
        return _apply_delta(load(meta.base_model["spec"], dtype), path, meta)
    hf, tokenizer = _load_hf(path, dtype)
    if meta.mask_id is not None and tokenizer.convert_tokens_to_ids(MASK_TOKEN) != meta.mask_id:
        raise UserError(f"{path}: the tokenizer has no {MASK_TOKEN} token at id {meta.mask_id}, which "
                        f"{META_FILE} expects: copy the tokenizer files that came with the checkpoint")
    model = MTPModel(hf, tokenizer, meta)
    if meta.trainable == "gated-lora":
        model.attach_adapters(meta.lora_rank, meta.lora_alpha)
        lora.load_adapter_state(hf, load_file(path / ADAPTER_FILE))
        model.adapters_to(hf.dtype)
    return model


def _load_heads(model: MTPModel, path: Path, meta: MTPMeta) -> MTPModel:
    from mtplm.registry import HEAD_FORMS

    heads = HEAD_FORMS.get(meta.heads.get("form", "")).build(meta.heads)
    try:
        heads.load_state_dict(load_file(path / HEADS_FILE))
    except (OSError, RuntimeError) as exc:
        raise UserError(f"{path / HEADS_FILE} does not hold the heads {META_FILE} describes: {exc}") from None
    model.heads, model.meta = heads.to(model.dtype).eval(), meta
    return model


def _apply_delta(model: MTPModel, path: Path, meta: MTPMeta) -> MTPModel:
    delta = load_file(path / DELTA_FILE)
    model.add_mask_token(meta.k_max, meta.base_model)
    if model.meta.mask_id != meta.mask_id:
        raise UserError(f"{path}: mask id {meta.mask_id} does not match the base tokenizer ({model.meta.mask_id})")
    with torch.no_grad():
        model.hf.get_input_embeddings().weight[meta.mask_id] = delta.pop("mask_embedding")
        if "mask_head_row" in delta:
            model.hf.get_output_embeddings().weight[meta.mask_id] = delta.pop("mask_head_row")
    if meta.trainable == "gated-lora":
        model.attach_adapters(meta.lora_rank, meta.lora_alpha)
        lora.load_adapter_state(model.hf, delta)
        model.adapters_to(model.dtype)
    model.meta = meta
    return model


def save_heads(model: MTPModel, out_dir: str | os.PathLike) -> Path:
    """A head-based checkpoint: the heads' weights and metadata naming the base model. Atomic."""
    def write(tmp: Path) -> None:
        state = {k: v.float() if v.is_floating_point() else v for k, v in model.heads.state_dict().items()}
        save_file(_contiguous(state), tmp / HEADS_FILE)
        write_meta(tmp, model.meta)

    return atomic_dir(Path(out_dir), write)


def save(model: MTPModel, out_dir: str | os.PathLike) -> Path:
    """A full checkpoint: HF weights (LoRA merged), tokenizer, adapters, metadata. Atomic."""
    def write(tmp: Path) -> None:
        model.hf.save_pretrained(tmp, state_dict=_base_state(model.hf))
        model.tokenizer.save_pretrained(tmp)
        if model.gate is not None:
            save_file(_contiguous(lora.adapter_state(model.hf)), tmp / ADAPTER_FILE)
        write_meta(tmp, model.meta)

    return atomic_dir(Path(out_dir), write)


def save_delta(model: MTPModel, out_dir: str | os.PathLike, base_spec: str) -> Path:
    """Only what conversion added (mask rows + gated adapters), naming the base model. Atomic."""
    if model.meta.trainable != "gated-lora":
        raise UserError("a delta checkpoint holds adapters; use save() for full or merged-LoRA models")
    mask_id = model.meta.mask_id
    tensors = {"mask_embedding": model.hf.get_input_embeddings().weight[mask_id].float()}
    head = model.hf.get_output_embeddings().weight
    if head.data_ptr() != model.hf.get_input_embeddings().weight.data_ptr():
        tensors["mask_head_row"] = head[mask_id].float()
    tensors.update(lora.adapter_state(model.hf))
    meta = MTPMeta(**{**asdict(model.meta), "delta": True})
    meta.base_model = {**meta.base_model, "spec": base_spec}

    def write(tmp: Path) -> None:
        # adapters in float16 keep the shipped file small; the mask rows stay float32
        save_file(_contiguous({k: v.half() if ".lora_" in k else v for k, v in tensors.items()}), tmp / DELTA_FILE)
        write_meta(tmp, meta)

    return atomic_dir(Path(out_dir), write)


def _load_hf(path, dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(dtype))
    hf.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return hf, tokenizer


def _base_state(hf) -> dict[str, torch.Tensor]:
    """The HF state dict without our adapter tensors, under the names HF expects."""
    state = {}
    for name, value in hf.state_dict().items():
        if ".lora_" in name:
            continue
        state[name.replace(".base.weight", ".weight").replace(".base.bias", ".bias")] = value
    return state


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in tensors.items()}


def write_meta(directory: Path, meta: MTPMeta) -> None:
    (directory / META_FILE).write_text(json.dumps(asdict(meta), indent=2) + "\n")


def read_meta(directory: Path) -> MTPMeta:
    try:
        return MTPMeta(**json.loads((directory / META_FILE).read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise UserError(f"{directory / META_FILE} is not a readable mtplm metadata file: {exc}") from None


def shipped(spec: str) -> Path | None:
    """The directory of a checkpoint shipped inside the package under that name, if there is one."""
    folder = SHIPPED / str(spec)
    return folder if str(spec) and "/" not in str(spec) and (folder / META_FILE).is_file() else None


def checkpoint_dir(spec: str) -> Path:
    """The directory of a converted checkpoint given by shipped name or path (UserError if it is none)."""
    path = shipped(spec) or Path(spec)
    if not (path / META_FILE).is_file():
        raise UserError(f"{spec} is not a converted checkpoint (no {META_FILE}): convert it with `mtplm train`")
    return path


def load_model(spec: str, dtype: str = "fp32") -> MTPModel:
    """A shipped checkpoint name (see mtplm/checkpoints), a checkpoint directory, or any base model spec."""
    return load(shipped(spec) or spec, dtype)
