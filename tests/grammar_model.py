"""A tiny model over a byte-level BPE tokenizer trained in-process on JSON-ish text (for constraint tests):
the word-level test tokenizer cannot spell JSON, this one can spell anything."""

from __future__ import annotations

import torch
from conftest import tiny_llama
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from mtplm.model import MTPModel

SAMPLES = [
    '{"name": "Ada", "age": 36, "tags": ["admin", "user"]}',
    '{"ok": true, "count": 12, "items": []}',
    '{"city": "Paris", "zip": "75001", "open": false}',
    "SELECT name FROM users WHERE age >= 21;",
    "2026-12-02 1999-01-31",
    '{"a": {"b": [1, 2, 3]}, "c": null}',
] * 20


def json_tokenizer(merges: int = 120) -> PreTrainedTokenizerFast:
    """256 byte tokens, `merges` BPE merges learned from SAMPLES, then <eos> and <pad> (the last two ids)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + merges, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(SAMPLES, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    tok.add_special_tokens({"eos_token": "<eos>", "pad_token": "<pad>"})
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tok


def json_mtp(seed: int = 0, k_max: int = 4, converted: bool = True) -> MTPModel:
    """A random tiny Llama over json_tokenizer (with an <mtp> token when `converted`), fp32."""
    tok = json_tokenizer()
    hf = tiny_llama(seed=seed, vocab=len(tok), hidden=32)
    assert hf.config.eos_token_id == tok.eos_token_id
    model = MTPModel(hf, tok, None)
    if converted:
        model.add_mask_token(k_max=k_max, base_identity={"name": "tiny-json", "seed": seed})
        model.attach_gated_lora(rank=4, alpha=8.0)  # a saved conversion has adapters (modelio reloads them)
    torch.manual_seed(seed)
    return model
