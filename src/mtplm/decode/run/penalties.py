"""Penalties and logit bias (config/penalties.py) applied to a pass's next-token rows. Pure functions of
the logits and the text each row follows.

Each row is penalized with the counts as of its own position: a verified pass's row after draft i counts
the committed text and the drafts on the path to draft i, exactly the text plain decoding would have
committed when it scored that position, so verification stays exact under penalties. The operations are
elementwise, so a row penalized inside a wide pass is bitwise the row penalized alone.

Shapes: R rows, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mtplm.config import Penalties
from mtplm.decode.sampling import greedy


class Penalizer:
    """One sequence's penalties over its committed text (`text`, read as it grows; the first `prompt_len`
    tokens are the prompt, which the repetition penalty counts and presence and frequency do not)."""

    def __init__(self, penalties: Penalties, text: list[int], prompt_len: int) -> None:
        self.penalties, self.text, self.prompt_len = penalties, text, prompt_len

    def rows(self, logits: torch.Tensor, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """logits [R, V] -> penalized [R, V]: row r follows the committed text and then paths[r]."""
        rows, vocab = len(logits), logits.shape[-1]
        device = logits.device
        output = torch.tensor(self.text[self.prompt_len :], dtype=torch.long, device=device)
        counts = torch.bincount(output, minlength=vocab)[:vocab].to(logits.dtype).repeat(rows, 1)  # [R, V]
        for r, path in enumerate(paths):
            for token in path:
                counts[r, token] += 1
        seen = None
        if self.penalties.repetition != 1:
            prompt = torch.tensor(self.text[: self.prompt_len], dtype=torch.long, device=device)
            in_prompt = torch.bincount(prompt, minlength=vocab)[:vocab] > 0  # [V]
            seen = in_prompt.unsqueeze(0) | (counts > 0)  # [R, V]
        return penalize(logits, self.penalties, counts, seen)

    def chain(self, block: torch.Tensor, path: Sequence[int]) -> torch.Tensor:
        """A block's rows [n, V] penalized along their own greedy chain: row j follows the committed text,
        `path`, then the greedy tokens of the penalized rows before it."""
        out, chain = [], list(path)
        for j in range(len(block)):
            row = self.rows(block[j : j + 1], [chain])  # [1, V]
            out.append(row)
            chain.append(int(greedy(row[0])))
        return torch.cat(out) if out else block


def penalizer(penalties: Penalties | None, text: list[int], prompt_len: int) -> Penalizer | None:
    """A sequence's Penalizer, or None where the penalties change nothing."""
    return None if penalties is None or penalties.neutral else Penalizer(penalties, text, prompt_len)


def penalize(
    logits: torch.Tensor, penalties: Penalties, counts: torch.Tensor, seen: torch.Tensor | None
) -> torch.Tensor:
    """logits [R, V] with the repetition penalty on the `seen` tokens [R, V] (bool; None: no repetition
    penalty), then the presence and frequency penalties by each token's output `counts` [R, V], then the
    logit bias."""
    logits = logits.float()
    if seen is not None:
        scaled = torch.where(logits > 0, logits / penalties.repetition, logits * penalties.repetition)
        logits = torch.where(seen, scaled, logits)
    if penalties.frequency:
        logits = logits - penalties.frequency * counts
    if penalties.presence:
        logits = logits - penalties.presence * (counts > 0).to(logits.dtype)
    if penalties.logit_bias:
        ids = torch.tensor([t for t, _ in penalties.logit_bias], dtype=torch.long, device=logits.device)
        bias = torch.tensor([b for _, b in penalties.logit_bias], dtype=logits.dtype, device=logits.device)
        keep = ids < logits.shape[-1]
        logits = logits.clone()
        logits[:, ids[keep]] += bias[keep]
    return logits
