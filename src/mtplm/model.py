"""MTPModel: an unmodified Hugging Face causal LM plus one `<mtp>` mask token, optional adapters, metadata.

A converted checkpoint is an ordinary HF checkpoint (loads with `AutoModelForCausalLM.from_pretrained`)
with `mtplm.json` beside it; gated-LoRA adapters, which plain HF cannot express, sit in
`gated_lora.safetensors`. A *delta* checkpoint stores only what conversion added (the mask token's
rows and the adapters) and names its base model; it is what ships inside the package.

Shapes: B batch, S sequence (fed tokens), V vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mtplm import lora
from mtplm.errors import UserError
from mtplm.files import atomic_dir

MASK_TOKEN = "<mtp>"
META_FILE = "mtplm.json"
ADAPTER_FILE = "gated_lora.safetensors"
HEADS_FILE = "heads.safetensors"
DELTA_FILE = "delta.safetensors"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class MTPMeta:
    """What mtplm records beside a converted checkpoint."""

    mask_id: int | None  # None for head-based checkpoints (no mask token)
    method: str = "mask"  # mask | heads
    mask_token: str = MASK_TOKEN
    k_max: int = 8
    trainable: str = "gated-lora"
    lora_rank: int = 0
    lora_alpha: float = 0.0
    thresholds: dict = field(default_factory=lambda: {"tau": 0.9, "confidence": "top1"})
    base_model: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)
    delta: bool = False
    heads: dict = field(default_factory=dict)  # method "heads": heads.Heads config (form, k, dim, intermediate)
    format_version: int = 1


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}: use fp32 or bf16")
    return DTYPES[name]

_LOADING = threading.RLock()  # MTPModel.load: one at a time (reentrant: a delta loads its base inside)


class MTPModel:
    """A causal LM that can read several future tokens from mask slots appended to its input."""

    def __init__(self, hf, tokenizer, meta: MTPMeta | None, gate: lora.Gate | None = None) -> None:
        self.hf = hf
        self.tokenizer = tokenizer
        self.meta = meta
        self.gate = gate
        self.heads = None  # heads.Heads for method "heads"
        self._adapters_on = True

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def load(cls, spec: str | os.PathLike, dtype: str = "fp32") -> "MTPModel":
        """A converted checkpoint (full or delta), or a base model (plain decoding only).

        One load at a time per process: Hugging Face model construction changes process-wide state
        while it runs (torch's default dtype, patched torch functions), and two threads loading at once
        (a server loading two models) can restore each other's changes in the wrong order. A test run
        that did so left every model loaded afterwards with its weights on the meta device.
        """
        with _LOADING:
            return cls._load(spec, dtype)

    @classmethod
    def _load(cls, spec: str | os.PathLike, dtype: str) -> "MTPModel":
        from mtplm.assets.models import resolve_model

        path = Path(spec)
        if (path / META_FILE).is_file():
            meta = _read_meta(path)
            if meta.method == "heads":
                return cls.load(meta.base_model["spec"], dtype)._load_heads(path, meta)
            if meta.delta:
                base = cls.load(meta.base_model["spec"], dtype)
                return base._apply_delta(path, meta)
            hf, tokenizer = _load_hf(path, dtype)
            if meta.mask_id is not None and tokenizer.convert_tokens_to_ids(MASK_TOKEN) != meta.mask_id:
                raise UserError(f"{path}: the tokenizer has no {MASK_TOKEN} token at id {meta.mask_id}, which "
                                f"{META_FILE} expects: copy the tokenizer files that came with the checkpoint")
            model = cls(hf, tokenizer, meta)
            if meta.trainable == "gated-lora":
                model._attach_gated(meta.lora_rank, meta.lora_alpha)
                lora.load_adapter_state(hf, load_file(path / ADAPTER_FILE))
                model._adapters_to(hf.dtype)
            return model
        hf, tokenizer = _load_hf(resolve_model(str(spec)), dtype)
        return cls(hf, tokenizer, None)

    def add_mask_token(self, k_max: int, base_identity: dict, seed: int = 0) -> None:
        """Add `<mtp>` with embedding (and untied LM-head) rows drawn from N(mean, cov) of the existing rows."""
        tok = self.tokenizer
        if MASK_TOKEN not in tok.get_vocab():
            tok.add_special_tokens({"additional_special_tokens": [MASK_TOKEN]}, replace_extra_special_tokens=False)
        mask_id = tok.convert_tokens_to_ids(MASK_TOKEN)
        emb = self.hf.get_input_embeddings()
        num_rows = emb.weight.shape[0]
        if mask_id >= num_rows:
            self.hf.resize_token_embeddings(mask_id + 1, mean_resizing=False)
        generator = torch.Generator().manual_seed(seed)
        weights = [self.hf.get_input_embeddings().weight]
        head = self.hf.get_output_embeddings()
        if head is not None and head.weight.data_ptr() != weights[0].data_ptr():
            weights.append(head.weight)
        with torch.no_grad():
            for weight in weights:
                weight[mask_id] = _sample_like_rows(weight[: min(num_rows, mask_id)], generator).to(weight.dtype)
        self.meta = MTPMeta(mask_id=mask_id, k_max=k_max, base_model=base_identity)

    def attach_gated_lora(self, rank: int, alpha: float) -> None:
        self._attach_gated(rank, alpha)
        self.meta.trainable, self.meta.lora_rank, self.meta.lora_alpha = "gated-lora", rank, alpha

    def _attach_gated(self, rank: int, alpha: float) -> None:
        self.gate = lora.attach_gated_lora(self.hf, rank, alpha)
        # the adapters compute in float32 but must live on the base model's device
        device = next(self.hf.parameters()).device
        for p in lora.adapter_parameters(self.hf):
            p.data = p.data.to(device=device, dtype=torch.float32)

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
        self.meta = MTPMeta(mask_id=None, method="heads", k_max=heads.k, trainable="heads",
                            thresholds={"tau": 0.9, "confidence": "top1", "k_max": heads.k},
                            base_model={**base_identity, "spec": spec}, delta=True, heads=heads.config())

    def _load_heads(self, path: Path, meta: MTPMeta) -> "MTPModel":
        from mtplm.heads.forms import Heads

        heads = Heads(**meta.heads)
        try:
            heads.load_state_dict(load_file(path / HEADS_FILE))
        except (OSError, RuntimeError) as exc:
            raise UserError(f"{path / HEADS_FILE} does not hold the heads {META_FILE} describes: {exc}") from None
        self.heads, self.meta = heads.to(self.dtype).eval(), meta
        return self

    def save_heads(self, out_dir: str | os.PathLike) -> Path:
        """A head-based checkpoint: the heads' weights and metadata naming the base model. Atomic."""
        def write(tmp: Path) -> None:
            save_file(_contiguous({k: v.float() for k, v in self.heads.state_dict().items()}), tmp / HEADS_FILE)
            _write_meta(tmp, self.meta)

        return atomic_dir(Path(out_dir), write)

    def draft_block(self, hidden: torch.Tensor, token: int, n: int) -> torch.Tensor:
        """Heads 2..n+1's logits [n, V] at one row's hidden state [D]; `token` follows that row."""
        return self.heads.draft_logits(hidden, token, n, self.hf.get_input_embeddings(), self.head)

    def _adapters_to(self, dtype: torch.dtype) -> None:
        """For inference: adapters in the base dtype, so the forward pass casts nothing."""
        for p in lora.adapter_parameters(self.hf):
            p.data = p.data.to(dtype)
        self.gate.dtype = dtype

    def _apply_delta(self, path: Path, meta: MTPMeta) -> "MTPModel":
        delta = load_file(path / DELTA_FILE)
        self.add_mask_token(meta.k_max, meta.base_model)
        if self.meta.mask_id != meta.mask_id:
            raise UserError(f"{path}: mask id {meta.mask_id} does not match the base tokenizer ({self.meta.mask_id})")
        with torch.no_grad():
            self.hf.get_input_embeddings().weight[meta.mask_id] = delta.pop("mask_embedding")
            if "mask_head_row" in delta:
                self.hf.get_output_embeddings().weight[meta.mask_id] = delta.pop("mask_head_row")
        if meta.trainable == "gated-lora":
            self._attach_gated(meta.lora_rank, meta.lora_alpha)
            lora.load_adapter_state(self.hf, delta)
            self._adapters_to(self.dtype)
        self.meta = meta
        return self

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

    def decoder_states(self, input_ids, position_ids=None, cache=None, attention_mask=None):
        """Final-norm hidden states [B, S, D] (the LM head is applied only where logits are needed)."""
        with self._gated(input_ids):
            return self.hf.get_decoder()(
                input_ids=input_ids, position_ids=position_ids, cache=cache,
                attention_mask=attention_mask, use_cache=cache is not None,
            ).last_hidden_state

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
                input_ids=input_ids, position_ids=position_ids, cache=cache,
                attention_mask=attention_mask, use_cache=cache is not None, logits_to_keep=last,
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
            is_mask = input_ids == self.meta.mask_id  # [B, S]
            if bool(is_mask.any()):
                self.gate.open(is_mask)
        try:
            yield
        finally:
            self.gate.rows = None

    # ---- saving ---------------------------------------------------------------------------------
    def save(self, out_dir: str | os.PathLike) -> Path:
        """A full checkpoint: HF weights (LoRA merged), tokenizer, adapters, metadata. Atomic."""
        def write(tmp: Path) -> None:
            self.hf.save_pretrained(tmp, state_dict=_base_state(self.hf))
            self.tokenizer.save_pretrained(tmp)
            if self.gate is not None:
                save_file(_contiguous(lora.adapter_state(self.hf)), tmp / ADAPTER_FILE)
            _write_meta(tmp, self.meta)

        return atomic_dir(Path(out_dir), write)

    def save_delta(self, out_dir: str | os.PathLike, base_spec: str) -> Path:
        """Only what conversion added (mask rows + gated adapters), naming the base model. Atomic."""
        if self.meta.trainable != "gated-lora":
            raise UserError("a delta checkpoint holds adapters; use save() for full or merged-LoRA models")
        mask_id = self.meta.mask_id
        tensors = {"mask_embedding": self.hf.get_input_embeddings().weight[mask_id].float()}
        head = self.hf.get_output_embeddings().weight
        if head.data_ptr() != self.hf.get_input_embeddings().weight.data_ptr():
            tensors["mask_head_row"] = head[mask_id].float()
        tensors.update(lora.adapter_state(self.hf))
        meta = MTPMeta(**{**asdict(self.meta), "delta": True})
        meta.base_model = {**meta.base_model, "spec": base_spec}

        def write(tmp: Path) -> None:
            # adapters in float16 keep the shipped file small; the mask rows stay float32
            save_file(_contiguous({k: v.half() if ".lora_" in k else v for k, v in tensors.items()}), tmp / DELTA_FILE)
            _write_meta(tmp, meta)

        return atomic_dir(Path(out_dir), write)


def _load_hf(path, dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(dtype))
    hf.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return hf, tokenizer


def _sample_like_rows(rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw from N(mean, cov) of the given rows [N, D] (diagonal fallback if cov is not PD)."""
    rows = rows.double()
    mean = rows.mean(0)
    centered = rows - mean
    cov = centered.T @ centered / max(1, rows.shape[0] - 1)
    z = torch.randn(rows.shape[1], generator=generator, dtype=torch.float64)
    chol, info = torch.linalg.cholesky_ex(cov + 1e-6 * torch.eye(rows.shape[1], dtype=torch.float64))
    if int(info) == 0:
        return (mean + chol @ z).float()
    return (mean + centered.std(0) * z).float()


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


def _write_meta(directory: Path, meta: MTPMeta) -> None:
    (directory / META_FILE).write_text(json.dumps(asdict(meta), indent=2) + "\n")


def _read_meta(directory: Path) -> MTPMeta:
    try:
        return MTPMeta(**json.loads((directory / META_FILE).read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise UserError(f"{directory / META_FILE} is not a readable mtplm metadata file: {exc}") from None


SHIPPED = Path(__file__).parent / "checkpoints"


def _shipped(spec: str) -> Path | None:
    """The directory of a checkpoint shipped inside the package under that name, if there is one."""
    shipped = SHIPPED / str(spec)
    return shipped if str(spec) and "/" not in str(spec) and (shipped / META_FILE).is_file() else None


def checkpoint_dir(spec: str) -> Path:
    """The directory of a converted checkpoint given by shipped name or path (UserError if it is none)."""
    path = _shipped(spec) or Path(spec)
    if not (path / META_FILE).is_file():
        raise UserError(f"{spec} is not a converted checkpoint (no {META_FILE}): convert it with `mtplm train`")
    return path


def load_model(spec: str, dtype: str = "fp32") -> MTPModel:
    """A shipped checkpoint name (see mtplm/checkpoints), a checkpoint directory, or any base model spec."""
    return MTPModel.load(_shipped(spec) or spec, dtype)
