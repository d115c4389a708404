"""The frozen trunk's states for head training (heads/train.py, heads/eagle3_train.py): one forward per
training text, computed once and cached on disk (`trunk_states`), a row of them (`TrunkRow`), and a padded
batch of rows with the targets each head learns (`HeadBatch`)."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from mtplm.files import atomic_file
from mtplm.model import MTPModel
from mtplm.train.data import Sample, row_ids


@dataclass(frozen=True)
class TrunkRow:
    hidden: torch.Tensor  # [L, D] final-norm hidden states of the frozen trunk
    tokens: torch.Tensor  # [L]
    greedy: torch.Tensor  # [L] the trunk's own greedy next token at each row
    start: int  # first row whose next token is part of the response
    features: torch.Tensor | None = None  # [L, 3D] the inputs of the drafter's feature layers (EAGLE-3)

    def window(self, rows: int, k: int, rng: random.Random) -> TrunkRow:
        """`rows` consecutive response rows (plus the k tokens their heads look ahead to), at random."""
        if not rows or len(self.tokens) - self.start <= rows + k:
            return self
        a = rng.randrange(self.start, len(self.tokens) - rows - k + 1)
        b = a + rows + k
        features = self.features[a:b] if self.features is not None else None
        return TrunkRow(self.hidden[a:b], self.tokens[a:b], self.greedy[a:b], 0, features)


@torch.inference_mode()
def trunk_states(
    model: MTPModel,
    samples: list[Sample],
    seq_len: int,
    progress: bool = True,
    cache: Path | None = None,
    layers: tuple[int, ...] = (),
) -> list[TrunkRow]:
    """One frozen-trunk forward per sample, kept for every epoch (hidden states in the model's dtype).

    With `layers`, each row also keeps the inputs of those decoder layers, concatenated (`features`;
    EAGLE-3). With `cache`, the states are stored under a key of the model, dtype, samples, seq_len (and
    layers), and reused by later runs on the same text (an ablation trains many heads on one trunk).
    """
    path = None
    if cache is not None:
        key = hashlib.sha256(
            json.dumps(
                [
                    model.meta_key(),
                    str(model.dtype),
                    seq_len,
                    [(s.prompt_ids, s.response_ids) for s in samples],
                ]
                + ([list(layers)] if layers else [])
            ).encode()
        )
        path = cache / f"trunk-{key.hexdigest()[:16]}.pt"
        if path.is_file():
            return [TrunkRow(**row) for row in torch.load(path)]
    rows = []
    for sample in tqdm(samples, desc="trunk states", unit="text", disable=not progress):
        ids, prompt_len = row_ids(sample, seq_len)
        states = model.decoder_states(torch.tensor([ids]), layers=layers)[0]  # [L, D * (1 + len(layers))]
        hidden = states[:, : states.shape[1] // (1 + len(layers))]
        features = states[:, hidden.shape[1] :].clone() if layers else None
        greedy = torch.cat([model.head(chunk).argmax(-1) for chunk in hidden.split(256)])
        rows.append(TrunkRow(hidden.clone(), torch.tensor(ids), greedy, max(0, prompt_len - 1), features))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_file(path, lambda tmp: torch.save([vars(row) for row in rows], tmp))
    return rows


@dataclass(frozen=True)
class HeadBatch:
    hidden: torch.Tensor  # [B, T, D] float32
    tokens: torch.Tensor  # [B, T]
    greedy: torch.Tensor  # [B, T]
    rows: torch.Tensor  # [B, T] bool: a response row (start <= t < length)
    lengths: torch.Tensor  # [B]
    features: torch.Tensor | None = None  # [B, T, 3D] float32 (EAGLE-3)

    @classmethod
    def of(cls, rows: list[TrunkRow]) -> HeadBatch:
        width, dim = max(len(r.tokens) for r in rows), rows[0].hidden.shape[-1]
        hidden = torch.zeros(len(rows), width, dim)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        greedy = torch.zeros_like(tokens)
        first = rows[0].features
        features = torch.zeros(len(rows), width, first.shape[-1]) if first is not None else None
        for i, r in enumerate(rows):
            n = len(r.tokens)
            hidden[i, :n], tokens[i, :n], greedy[i, :n] = r.hidden.float(), r.tokens, r.greedy
            tokens[i, n:] = r.tokens[-1]
            if features is not None and r.features is not None:
                features[i, :n] = r.features.float()
        t = torch.arange(width)
        lengths = torch.tensor([len(r.tokens) for r in rows])
        starts = torch.tensor([r.start for r in rows])
        return cls(hidden, tokens, greedy, (t >= starts[:, None]) & (t < lengths[:, None]), lengths, features)

    def valid(self, k: int) -> torch.Tensor:
        """[B, T]: rows where head k has a target (token t+k exists)."""
        return self.rows & (torch.arange(self.tokens.shape[1]) + k < self.lengths[:, None])

    def targets(self, k: int, objective: str) -> torch.Tensor:
        """[B, T] token t+k: the trunk's greedy choice at row t+k-1, or the text's token."""
        source = self.tokens if objective == "ground-truth" else self.greedy
        shift = k if objective == "ground-truth" else k - 1
        return torch.cat([source[:, shift:], source[:, -1:].expand(-1, shift)], 1)
