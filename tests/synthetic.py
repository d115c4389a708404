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


def pretrained_tiny_model(
    directory: Path, steps: int = 150, seed: int = 0, layers: int = 2, hidden: int = 64, rows: int = 0
) -> Path:
    """A tiny Llama taught the language by plain next-token training, saved as an HF directory; with `rows`,
    its vocabulary padded to that many embedding rows (as real models pad theirs)."""
    tokenizer = tiny_tokenizer()
    model = tiny_llama(seed=seed, layers=layers, hidden=hidden)
    if rows:
        model.resize_token_embeddings(rows, mean_resizing=False)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rows = chain_rows(2000, seed)
    for step in range(steps):
        chunk = rows[(step * 32) % len(rows) :][:32]
        ids = torch.tensor(
            [tokenizer(r["prompt"] + " " + r["response"] + " <eos>")["input_ids"] for r in chunk]
        )
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

    settings = dict(
        model=str(base_dir),
        out=str(out),
        data=f"jsonl:{data_file}",
        k_max=4,
        steps=300,
        batch_size=16,
        seq_len=32,
        slots_per_seq=24,
        region_width=8,
        lr=1e-2,
        lora_rank=8,
        lora_alpha=16.0,
        dtype="fp32",
        val_every=100,
        warmup_steps=5,
        save_every=1000,
    )
    return TrainConfig(**{**settings, **overrides})


def second_token_check(model, prompt: list[int], sample_two, n: int = 3000) -> tuple[float, int]:
    """Sampling exactness at temperature 1: the total-variation distance between the second sampled token
    over seeds 0..n-1 (`sample_two(seed) -> (tokens, drafts kept)`) and its exact distribution
    sum_t1 p(t1) p(t2 | t1), and how many drafts were kept in all."""
    vocab = model.hf.config.vocab_size
    with torch.no_grad():
        p1 = torch.softmax(model.logits(torch.tensor([prompt]))[0, -1], -1)
        p2 = torch.softmax(model.logits(torch.tensor([prompt + [t] for t in range(vocab)]))[:, -1], -1)
    counts, kept = torch.zeros(vocab), 0
    for seed in range(n):
        tokens, accepted = sample_two(seed)
        counts[tokens[1]] += 1
        kept += accepted
    return float(0.5 * (counts / n - p1 @ p2).abs().sum()), kept
