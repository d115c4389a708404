"""MTPModel: an unmodified Hugging Face causal LM plus one `<mtp>` mask token, optional adapters, metadata.

The model adds the mask token, attaches adapters or heads, and runs the forward pass; `load_model` (also
`MTPModel.load`) builds one from a checkpoint. The checkpoint files' formats are modelio.py's, which sits
below this module and never imports it.

Shapes: B batch, S sequence (fed tokens), V vocabulary.
"""

from __future__ import annotations

import hashlib
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from mtplm import lora, modelio
from mtplm.assets.embedding import resize_vocab, set_row
from mtplm.assets.quantized import GGUFWeights, quantized_model
from mtplm.config import Thresholds
from mtplm.errors import UserError
from mtplm.modelio import ADAPTER_FILE, DELTA_FILE, HEADS_FILE, MASK_TOKEN, META_FILE, MTPMeta, read_meta

_LOADING = threading.RLock()  # load: one at a time (reentrant: a delta loads its base inside)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPES |= {"auto": torch.bfloat16, "gguf": torch.bfloat16}  # gguf: its linears as they are (assets/quantized)


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}: use fp32 or bf16")
    return DTYPES[name]


class MTPModel:
    """A causal LM that can read several future tokens from mask slots appended to its input."""

    def __init__(self, hf, tokenizer, meta: MTPMeta | None, gate: lora.Gate | None = None) -> None:
        self.hf = hf
        self.tokenizer = tokenizer
        self.meta = meta
        self.gate = gate
        self.heads: Any = None  # method "heads": heads.forms.Heads, or heads.eagle3.Eagle3Drafter
        self._adapters_on = True
        # False: a compiled backend's packed weights replace the HF modules' own (one copy in memory; HF's
        # forward then runs mtplm's kernels); True keeps HF's weights and kernels (the bench's HF rows)
        self.hf_exact = False
        self.gguf: GGUFWeights | None = None  # the GGUF's linear weights, where hf has none (meta)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def load(cls, spec: str | os.PathLike, dtype: str = "fp32") -> MTPModel:
        """A shipped checkpoint name, a converted checkpoint (full, delta or heads) or a base model:
        load_model."""
        return load_model(spec, dtype)

    def add_mask_token(self, k_max: int, base_identity: dict, seed: int = 0) -> None:
        """Add `<mtp>` with embedding (and untied LM-head) rows drawn from N(mean, cov) of the existing
        rows."""
        tok = self.tokenizer
        if MASK_TOKEN not in tok.get_vocab():
            tok.add_special_tokens(
                {"additional_special_tokens": [MASK_TOKEN]}, replace_extra_special_tokens=False
            )
        mask_id = tok.convert_tokens_to_ids(MASK_TOKEN)
        emb = self.hf.get_input_embeddings()
        num_rows = emb.weight.shape[0]
        if mask_id >= num_rows:
            resize_vocab(self.hf, mask_id + 1)
        generator = torch.Generator().manual_seed(seed)
        weights = [self.hf.get_input_embeddings().weight]
        head = self.hf.get_output_embeddings()
        if head is not None and head.weight.data_ptr() != weights[0].data_ptr():
            weights.append(head.weight)
        with torch.no_grad():
            for weight in [w for w in weights if not w.is_meta]:  # a GGUF's rows: its delta sets them
                weight[mask_id] = _sample_like_rows(weight[: min(num_rows, mask_id)], generator).to(weight)
        self.meta = MTPMeta(mask_id=mask_id, k_max=k_max, base_model=base_identity)

    def attach_gated_lora(self, rank: int, alpha: float) -> None:
        self.attach_adapters(rank, alpha)
        assert self.meta is not None, "add_mask_token first"
        self.meta.trainable, self.meta.lora_rank, self.meta.lora_alpha = "gated-lora", rank, alpha

    def attach_adapters(self, rank: int, alpha: float) -> None:
        self.gate = lora.attach_gated_lora(self.hf, rank, alpha)
        device = next(p.device for p in self.hf.parameters() if not p.is_meta)  # adapters: f32, the model's
        for p in lora.adapter_parameters(self.hf):
            p.data = p.data.to(device=device, dtype=torch.float32)

    def tensors(self) -> list[torch.Tensor]:
        """Every parameter and buffer of the model and its heads."""
        modules = [self.hf] if self.heads is None else [self.hf, self.heads]
        tensors = (tensor for module in modules for tensor in (*module.parameters(), *module.buffers()))
        return [tensor for tensor in tensors if not tensor.is_meta]  # meta: a GGUF's linears, not held

    def nbytes(self) -> int:
        """Bytes of its tensors in memory (a storage several of them share, counted once)."""
        return storage_bytes(self.tensors())

    def meta_key(self) -> str:
        """A fingerprint of this model's weights for caches: every tensor's shape and first values."""
        digest = hashlib.sha256()
        for name, p in self.hf.state_dict().items():
            digest.update(f"{name}{tuple(p.shape)}".encode())
            digest.update(p.detach().flatten()[:4096].float().numpy().tobytes())
        return digest.hexdigest()

    def attach_heads(self, heads, base_identity: dict, spec: str) -> None:
        """Make this base model a head-based MTP model (heads.Heads on its frozen trunk)."""
        self.heads = heads.eval()
        self.meta = MTPMeta(
            mask_id=None,
            method="heads",
            k_max=heads.k,
            trainable="heads",
            thresholds=Thresholds().to_json(),
            base_model={**base_identity, "spec": spec},
            delta=True,
            heads=heads.config(),
        )

    def save_heads(self, out_dir: str | os.PathLike) -> Path:
        """A head-based checkpoint (modelio.save_heads)."""

        return modelio.save_heads(self, out_dir)

    def draft_block(self, hidden: torch.Tensor, token: int, n: int) -> torch.Tensor:
        """Heads 2..n+1's logits [n, V] at one row's hidden state [D]; `token` follows that row."""
        return self.heads.draft_logits(hidden, token, n, self.hf.get_input_embeddings(), self.head)

    def new_drafter(self):
        """One sequence's drafter (decode.protocol.Drafter): what it keeps between passes is its own."""
        return self.heads.drafter(self.hf.get_input_embeddings(), self.head)

    def adapters_to(self, dtype: torch.dtype) -> None:
        """For inference: adapters in the base dtype, so the forward pass casts nothing."""
        for p in lora.adapter_parameters(self.hf):
            p.data = p.data.to(dtype)
        assert self.gate is not None, "attach_adapters first"
        self.gate.dtype = dtype

    # ---- forward --------------------------------------------------------------------------------
    @property
    def mask_id(self) -> int:
        if self.meta is None or self.meta.mask_id is None:
            raise UserError("this model has no <mtp> token: convert it first with `mtplm train`")
        return self.meta.mask_id

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.get_input_embeddings().weight.dtype

    @contextmanager
    def adapters_disabled(self):
        """The base model: the distillation teacher, and the verifier for lossless decoding."""
        previous, self._adapters_on = self._adapters_on, False
        try:
            if hasattr(self.hf, "disable_adapter"):  # a peft LoRA model
                with self.hf.disable_adapter():
                    yield self
            else:
                yield self
        finally:
            self._adapters_on = previous

    @contextmanager
    def pristine(self):
        """The unmodified base module graph (no adapter wrappers): the honest plain-decoding baseline.

        Gated adapters never act without mask tokens, so plain decoding gives the same tokens either way;
        this only removes the wrappers' per-layer call overhead from the baseline's timing.
        """
        if self.gate is None:
            yield self
        else:
            with lora.unwrapped(self.hf), self.adapters_disabled():
                yield self

    def decoder_states(
        self, input_ids, position_ids=None, cache=None, attention_mask=None, layers: tuple[int, ...] = ()
    ):
        """Final-norm hidden states [B, S, D] (the LM head is applied only where logits are needed).

        With `layers`, rows [B, S, D * (1 + len(layers))]: the final states, then the residual stream entering
        each listed decoder layer (Hugging Face's hidden_states[i]; what vLLM and llama.cpp call layer i's
        input), in the order given: the features an EAGLE-3 drafter reads.
        """
        with self._gated(input_ids):
            out = self.hf.get_decoder()(
                input_ids=input_ids,
                position_ids=position_ids,
                cache=cache,
                attention_mask=attention_mask,
                use_cache=cache is not None,
                output_hidden_states=bool(layers),
            )
        if not layers:
            return out.last_hidden_state
        return torch.cat([out.last_hidden_state] + [out.hidden_states[i] for i in layers], -1)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The decoder layers whose inputs the drafter reads beside the final states (EAGLE-3), else ()."""
        return tuple(self.heads.feature_layers) if self.heads is not None else ()

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits [..., V] in float32, with the mask token never predicted."""
        logits = self.hf.get_output_embeddings()(hidden).float()
        if self.meta is not None and self.meta.mask_id is not None:
            logits[..., self.meta.mask_id] = float("-inf")
        return logits

    def logits(self, input_ids, position_ids=None, cache=None, attention_mask=None, last: int = 0):
        """Logits [B, last or S, V] of one forward pass (appends the fed tokens to `cache`)."""
        with self._gated(input_ids):
            out = self.hf(
                input_ids=input_ids,
                position_ids=position_ids,
                cache=cache,
                attention_mask=attention_mask,
                use_cache=cache is not None,
                logits_to_keep=last,
            )
        logits = out.logits.float()
        if self.meta is not None and self.meta.mask_id is not None:
            logits[..., self.meta.mask_id] = float("-inf")
        return logits

    @contextmanager
    def _gated(self, input_ids: torch.Tensor):
        if self.gate is None:
            yield
            return
        self.gate.rows = None
        if self._adapters_on:
            is_mask = input_ids.eq(self.mask_id)  # [B, S]
            if bool(is_mask.any()):
                self.gate.open(is_mask)
        try:
            yield
        finally:
            self.gate.rows = None

    # ---- saving (the formats live in modelio.py) --------------------------------------------------
    def save(self, out_dir: str | os.PathLike) -> Path:
        """A full checkpoint: HF weights (LoRA merged), tokenizer, adapters, metadata. Atomic."""

        return modelio.save(self, out_dir)

    def save_delta(self, out_dir: str | os.PathLike, base_spec: str) -> Path:
        """Only what conversion added (mask rows + gated adapters), naming the base model. Atomic."""

        return modelio.save_delta(self, out_dir, base_spec)


def _sample_like_rows(rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw from N(mean, cov) of the given rows [N, D] (diagonal fallback if cov is not PD), made on the
    CPU (the generator's device) whatever device the rows and the default device are: the same row
    everywhere."""
    rows = rows.detach().to("cpu", torch.float64)
    mean = rows.mean(0)
    centered = rows - mean
    cov = centered.T @ centered / max(1, rows.shape[0] - 1)
    z = torch.randn(rows.shape[1], generator=generator, dtype=torch.float64, device="cpu")
    chol, info = torch.linalg.cholesky_ex(
        cov + 1e-6 * torch.eye(rows.shape[1], dtype=torch.float64, device="cpu")
    )
    if int(info) == 0:
        return (mean + chol @ z).float()
    return (mean + centered.std(0) * z).float()


def storage_bytes(tensors: list, exclude: list | None = None) -> int:
    """Bytes of the distinct storages under `tensors` (None entries skipped), less those `exclude` holds; an
    opaque tensor (oneDNN's packed weights) counts as a storage of its own."""

    def storage(tensor: torch.Tensor) -> tuple[int, int]:
        if tensor.is_mkldnn:
            return id(tensor), tensor.numel() * tensor.element_size()
        return tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()

    seen = {storage(tensor)[0] for tensor in exclude or [] if tensor is not None}
    held = dict(storage(tensor) for tensor in tensors if tensor is not None)
    return sum(nbytes for key, nbytes in held.items() if key not in seen)


def load_model(spec: str | os.PathLike, dtype: str = "fp32") -> MTPModel:
    """A shipped checkpoint name (see mtplm/checkpoints), a checkpoint directory, or any base model spec."""
    return _load_locked(modelio.shipped(str(spec)) or spec, dtype)


def _load_locked(spec: str | os.PathLike, dtype: str = "fp32") -> MTPModel:
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
        directory = resolve_model(str(spec))  # (hf without linear weights, tokenizer, the GGUF's) or None
        hf, tokenizer, weights = quantized_model(directory, dtype) or (*_load_hf(directory, dtype), None)
        model = MTPModel(hf, tokenizer, None)
        model.gguf = weights
        return model
    meta = read_meta(path)
    if meta.method == "heads":
        return _load_heads(_load_locked(meta.base_model["spec"], dtype), path, meta)
    if meta.delta:
        return _apply_delta(_load_locked(meta.base_model["spec"], dtype), path, meta)
    if dtype == "gguf":
        raise UserError(f"{path} holds float weights: --dtype gguf runs a GGUF's own (use --dtype bf16)")
    hf, tokenizer = _load_hf(path, dtype)
    if meta.mask_id is not None and tokenizer.convert_tokens_to_ids(MASK_TOKEN) != meta.mask_id:
        raise UserError(
            f"{path}: the tokenizer has no {MASK_TOKEN} token at id {meta.mask_id}, which "
            f"{META_FILE} expects: copy the tokenizer files that came with the checkpoint"
        )
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
    if model.mask_id != meta.mask_id:
        raise UserError(f"{path}: mask id {meta.mask_id} does not match the base tokenizer ({model.mask_id})")
    with torch.no_grad():
        set_row(model.hf, meta.mask_id, delta.pop("mask_embedding"))  # (a GGUF's: assets/embedding.py)
        if "mask_head_row" in delta:
            model.hf.get_output_embeddings().weight[meta.mask_id] = delta.pop("mask_head_row")
    if meta.trainable == "gated-lora":
        model.attach_adapters(meta.lora_rank, meta.lora_alpha)
        lora.load_adapter_state(model.hf, delta)
        model.adapters_to(model.dtype)
    model.meta = meta
    return model


def _load_hf(path, dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = _from_weight_files(Path(path), parse_dtype(dtype))
    if hf is None:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(dtype))
    return hf.eval(), AutoTokenizer.from_pretrained(path)


def _from_weight_files(path: Path, dtype: torch.dtype):
    """The model at `path` built over weights read by modelio.read_weights (a peak of the model, not of the
    file mapped plus the model); None where Hugging Face's own loader must: no safetensors, a quantized or
    remote-code model, a dtype it cannot read."""
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    files = modelio.weight_files(path)
    if files is None:
        return None
    config = AutoConfig.from_pretrained(path)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if not isinstance(model_class, type) or getattr(config, "quantization_config", None) is not None:
        return None
    weights = modelio.read_weights(files, dtype)
    if weights is None:
        return None
    hf = model_class.from_pretrained(None, config=config, state_dict=weights, dtype=dtype)
    hf.config.name_or_path = hf.name_or_path = str(path)  # where it came from, as HF's loader records it
    if (path / "generation_config.json").is_file():  # its stop ids (backends.stop_ids)
        hf.generation_config = GenerationConfig.from_pretrained(path)
    return hf
