"""What the generation loop (decode/run/loop.py) hands out: a Step per forward pass, a whole Generation."""

from __future__ import annotations

from dataclasses import dataclass, field

from mtplm.decode.run.logprobs import TokenLogprob


@dataclass(frozen=True)
class Step:
    tokens: list[int]  # emitted this step (ends with the stop token if one was hit)
    offered: int  # k: the most tokens this pass could emit (Plan.k)
    cache_len: int  # cached positions after the step's crop
    stopped: bool
    drafted: int = 0  # drafts verified by this pass (verified mode)
    accepted: int = 0  # of which kept
    last: bool = False  # the generation ends here (a stop token, or max_new_tokens reached)
    logprobs: tuple[TokenLogprob, ...] | None = (
        None  # one per emitted token, when the Decoding asked for them
    )
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # prompt tokens 1.. (first step, when asked)
    forced: int = (
        0  # tokens the constraint forced: taken without a pass, or chosen where it allowed one token
    )
    complete: bool | None = None  # under a constraint: the output so far is complete (None: no constraint)


@dataclass
class Generation:
    prompt_len: int
    tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # tokens emitted per forward pass
    drafts: list[tuple[int, int]] = field(
        default_factory=list
    )  # (drafted, kept) per pass that verified drafts
    forced: int = 0  # tokens a constraint forced (in `tokens` and `accepted`, but chosen by no pass)
    complete: bool | None = None  # under a constraint: stopped with the output complete (None: no constraint)
    ttft_s: float = 0.0
    elapsed_s: float = 0.0
    stopped: bool = False

    @property
    def forwards(self) -> int:
        return len(self.accepted)

    @property
    def tokens_per_forward(self) -> float:
        return len(self.tokens) / max(1, self.forwards)

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / max(self.elapsed_s, 1e-9)
