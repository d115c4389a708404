"""A learnable synthetic language and a tiny model pretrained on it (for training tests)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from conftest import tiny_llama, tiny_tokenizer

MODULUS = 60  # tokens t0..t59 carry the language; t60, t61 unused, <eos>=62, <pad>=63


PERMUTATION = random.Random(1234).sample(range(MODULUS), MODULUS)


def chain_rows(n: int, seed: int, length: int = 24) -> list[dict]:
    """Walks of a fixed random permutation: each token determines every later one.

    Prompt = 2 tokens, response = the next `length`. Next-token training learns the permutation; the
    mask slots must learn its powers (slot j predicts perm^(j+1) of the last real token).
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        walk = [rng.randrange(MODULUS)]
        for _ in range(length + 1):
            walk.append(PERMUTATION[walk[-1]])
        terms = [f"t{t}" for t in walk]
        rows.append({"prompt": " ".join(terms[:2]), "response": " ".join(terms[2:])})
    return rows


def pretrained_tiny_model(directory: Path, steps: int = 150, seed: int = 0, layers: int = 2) -> Path:
    """A tiny Llama taught the language by plain next-token training, saved as an HF directory."""
    tokenizer = tiny_tokenizer()
    model = tiny_llama(seed=seed, layers=layers, hidden=64)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rows = chain_rows(2000, seed)
    for step in range(steps):
        chunk = rows[(step * 32) % len(rows):][:32]
        ids = torch.tensor([tokenizer(r["prompt"] + " " + r["response"] + " <eos>")["input_ids"] for r in chunk])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def train_config(base_dir: Path, data_file: Path, out: Path, **overrides):
    """The tests' training recipe on the chain language (gated LoRA unless overridden)."""
    from mtplm.config import TrainConfig

    settings = dict(model=str(base_dir), out=str(out), data=f"jsonl:{data_file}", k_max=4, steps=300,
                    batch_size=16, seq_len=32, slots_per_seq=24, region_width=8, lr=1e-2, lora_rank=8,
                    lora_alpha=16.0, dtype="fp32", val_every=100, warmup_steps=5, save_every=1000)
    return TrainConfig(**{**settings, **overrides})
