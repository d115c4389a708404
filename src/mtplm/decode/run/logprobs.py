"""Log-probabilities of the tokens a pass emitted (and of a prompt's tokens), for callers that ask.

Off by default: a Decoding computes them only when its `logprobs` is set, so plain decoding pays
nothing. The distribution of an emitted token is the model's own next-token distribution at the row
that precedes it in this pass (PassLogits.next_token: row 0 after the last committed token, row i+1
after draft i), which is exact for plain decoding and for kept drafts and the correction of verified
decoding. A lossy block (static k, ConfAdapt) emits tokens 2..n from mask slots: their values come from
that block's slot logits, the distribution they were chosen from, and are marked `exact=False`.

Values are the raw model's log-softmax (no temperature, top-k or top-p), as vLLM reports by default.
Shapes: R rows, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtplm.decode.protocol import Outcome, PassLogits

MAX_TOP = 20  # most alternatives per token a caller may ask for


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the `top` most likely tokens at this position, best first
    exact: bool = True  # False: read from a mask slot's logits, not the model's next-token path


def rows_logprobs(
    logits: torch.Tensor, tokens: list[int], top: int, exact: bool = True
) -> list[TokenLogprob]:
    """One TokenLogprob per row of logits [R, V] and its chosen token (len(tokens) == R)."""
    if not tokens:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    chosen = logp.gather(-1, torch.tensor(tokens, dtype=torch.long).view(-1, 1)).view(-1).tolist()
    if top:
        values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)  # [R, top]
        # a constraint's masked rows (decode/constraints/) hold -inf: such tokens are no alternatives
        alternatives = [
            tuple((t, x) for t, x in zip(i, v, strict=True) if x != float("-inf"))
            for i, v in zip(ids.tolist(), values.tolist(), strict=True)
        ]
    else:
        alternatives = [() for _ in tokens]
    return [TokenLogprob(t, lp, alt, exact) for t, lp, alt in zip(tokens, chosen, alternatives, strict=True)]


def step_logprobs(
    rows: PassLogits, outcome: Outcome, kept: list[int], top: int, block: torch.Tensor | None = None
) -> list[TokenLogprob]:
    """The kept drafts and the outcome's new tokens, in emission order (before any stop or budget cut);
    `block`: the block [n, V] whose leading tokens the pass emitted after its first new token, if it did."""
    before = [0] + [
        row + 1 for row in outcome.path
    ]  # next_token row before each kept draft, then the new one
    tokens = kept + list(outcome.new[:1])
    exact = rows_logprobs(rows.next_token[before[: len(tokens)]], tokens, top)
    rest = list(outcome.new[1:])
    if not rest or block is None:
        return exact
    return exact + rows_logprobs(block[: len(rest)], rest, top, exact=False)  # a lossy block: tokens 2..n


def prompt_logprobs(head, hidden: torch.Tensor, prompt: list[int], top: int) -> list[TokenLogprob]:
    """Prompt tokens 1.. scored by the rows before them; hidden [len(prompt), D] from the prefill pass."""
    return rows_logprobs(head(hidden[: len(prompt) - 1]), prompt[1:], top)


class Scores:
    """Logprobs on one sequence's passes (decoding.Decoding's `scores` hook): the `top` alternatives of
    every emitted token and, with `echo`, the prompt's own tokens (from its chunks' passes, then the first
    pass). Not there when the request asks for none, so plain decoding pays nothing."""

    def __init__(self, top: int, echo: bool) -> None:
        self.top, self.echo = top, echo
        self.echoed: list[TokenLogprob] = []  # the prompt chunks' token logprobs, before the first pass

    def chunk(self, head, hidden: torch.Tensor, following: list[int]) -> None:
        """A prompt chunk's rows [size, W] (echo: they score the prompt tokens after them)."""
        if self.echo:
            self.echoed += rows_logprobs(head(hidden[: len(following)]), following, self.top)

    def step(
        self, rows: PassLogits, outcome: Outcome, kept: list[int], block: torch.Tensor | None, count: int
    ) -> tuple[TokenLogprob, ...]:
        """The step's first `count` emitted tokens (kept drafts, then the new tokens; `block`: the lossy
        block the tokens after the first new one came from)."""
        return tuple(step_logprobs(rows, outcome, kept, self.top, block)[:count])

    def prompt(self, head, hidden: torch.Tensor, pending: list[int]) -> tuple[TokenLogprob, ...] | None:
        """With echo, on the first pass (it fed the prompt, after any chunks): every prompt token's."""
        if not self.echo:
            return None
        return tuple(self.echoed + prompt_logprobs(head, hidden, pending, self.top))
