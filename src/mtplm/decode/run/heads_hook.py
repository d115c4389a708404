"""A head drafter on one sequence's passes (decoding.Decoding's `drafter` hook): the block after the kept
path drafted by the model's heads (Medusa, sequential, EAGLE-3) from the pass's real rows, and, for a
drafter that keeps its own KV (EAGLE-3), the committed rows handed to it every pass.
"""

from __future__ import annotations

import torch

from mtplm.decode.protocol import Drafter, Outcome, Plan
from mtplm.decode.run.sequence import Committed


class HeadDrafts:
    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter

    def chunk(self, past: int, hidden: torch.Tensor, following: list[int]) -> None:
        """A prompt chunk's pass ran: its rows at positions past.. (a drafter with its own KV keeps them)."""
        if self.drafter.keeps_state:
            self.drafter.commit(past, hidden[: len(following)], following)

    def block(
        self, seq: Committed, plan: Plan, hidden: torch.Tensor, path: list[int], token: int, n: int
    ) -> torch.Tensor:
        """The block [n, V] after the pending tokens, drafts `path`, then `token`."""
        return self.drafter.block(seq.past, *_committed(seq, plan, hidden, path, token), n)

    def commit(self, seq: Committed, plan: Plan, hidden: torch.Tensor, outcome: Outcome) -> None:
        """The pass's outcome committed its path and first new token (before seq moves past them)."""
        if self.drafter.keeps_state:
            self.drafter.commit(seq.past, *_committed(seq, plan, hidden, outcome.path, outcome.new[0]))


def _committed(
    seq: Committed, plan: Plan, hidden: torch.Tensor, path: list[int], token: int
) -> tuple[torch.Tensor, list[int]]:
    """The fed rows [R, W] the committed text would end with if drafts `path` were kept (pending tokens
    first), and the token that follows each of them (`token` after the last)."""
    pending = len(seq.pending)
    index = list(range(pending)) + [pending + i for i in path]
    fed = seq.pending + [plan.drafts[i] for i in path]
    return hidden[index], fed[1:] + [token]
