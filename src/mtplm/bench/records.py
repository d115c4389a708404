"""The bench's records and their totals: one Record per prompt and mode, summed into a row per mode,
compared prompt by prompt with the mode it is measured against (plain, or an outside baseline's own) and
with the run's bf16 plain row (bench/rows.py), by the same `agreement`."""

from __future__ import annotations

from dataclasses import dataclass, field

from mtplm.config import PLAIN_MODE
from mtplm.decode.drafts.drafter import common_prefix


@dataclass(frozen=True)
class Record:
    """One prompt decoded in one mode."""

    source: str  # gsm8k | HumanEval | mtbench | sharegpt: structured vs open text
    tokens: list[int]
    seconds: float
    accepted: list[int]  # tokens per forward pass (empty for HF generate: it does not say)
    ttft_s: float | None
    peak_rss_mb: float
    scores: dict[str, float] = field(default_factory=dict)  # task metrics (tasks.score_example), 0 or 1 each
    passes: int | None = None  # forward passes, for outside engines that report them without `accepted`


def summarize(mode: str, records: list[Record], plain: list[Record]) -> dict:
    """Totals over records (tokens/s = all tokens / all seconds), compared prompt by prompt with plain."""
    tokens = sum(len(r.tokens) for r in records)
    seconds = sum(r.seconds for r in records)
    forwards = sum(len(r.accepted) if r.passes is None else r.passes for r in records)
    plain_rate = sum(len(r.tokens) for r in plain) / max(1e-9, sum(r.seconds for r in plain))
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    identical, prefix = agreement(records, plain)
    return {
        "mode": mode,
        "prompts": len(records),
        "tokens": tokens,
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "speedup": tokens / max(seconds, 1e-9) / max(plain_rate, 1e-9),
        "tokens_per_forward": tokens / forwards if forwards else None,
        "ms_per_forward": 1000 * seconds / forwards if forwards else None,
        "ttft_ms": 1000 * sum(ttfts) / len(ttfts) if ttfts else None,
        "peak_rss_mb": max(r.peak_rss_mb for r in records),
        "identical_outputs": identical,
        "prefix_agreement": prefix,
        "task_scores": _mean_scores(records),
        "task_accuracy": _task_accuracy(records),
    }


def agreement(records: list[Record], reference: list[Record]) -> tuple[float, float]:
    """(share of prompts whose tokens are the reference's, mean share of the reference's tokens before the
    first difference), prompt by prompt."""
    pairs = list(zip(records, reference, strict=False))
    identical = sum(a.tokens == b.tokens for a, b in pairs)
    prefix = sum(common_prefix(a.tokens, b.tokens) / max(1, len(b.tokens)) for a, b in pairs)
    return identical / len(reference), prefix / len(reference)


def summarize_all(
    records: dict[str, list[Record]],
    compared_with: dict[str, str],
    bf16_plain: str | None = None,
    weights: dict[str, str] | None = None,
) -> tuple[list[dict], dict[str, list[dict]]]:
    """A row per mode over every prompt, and the same rows per prompt source; each mode is compared with
    `compared_with[mode]`, plain (`ntp`) where it names none, and with the row `bf16_plain` (None: the run
    has none); `weights` names the weights kind of mtplm's rows."""
    reference = {name: records[compared_with.get(name, PLAIN_MODE)] for name in records}

    def rows_of(keep) -> list[dict]:
        def only(recs: list[Record]) -> list[Record]:
            return [r for r in recs if keep(r)]

        bf16 = only(records[bf16_plain]) if bf16_plain else None
        return [
            summarize(name, only(recs), only(reference[name]))
            | {"weights": (weights or {}).get(name)}
            | _versus_bf16(only(recs), bf16 if _same_model(name, compared_with) else None, bf16_plain)
            for name, recs in records.items()
        ]

    sources = sorted({r.source for r in records[PLAIN_MODE]})
    by_source = {src: rows_of(lambda r, src=src: r.source == src) for src in sources}
    return rows_of(lambda r: True), by_source


def _versus_bf16(records: list[Record], bf16: list[Record] | None, bf16_plain: str | None) -> dict:
    """A row's agreement with the bf16 plain row's records `bf16` (named `bf16_plain`; None: the run has
    none); None for a row of another model (`bf16` None)."""
    identical, prefix = agreement(records, bf16) if bf16 is not None else (None, None)
    return {
        "bf16_plain": bf16_plain,
        "identical_to_bf16_plain": identical,
        "prefix_agreement_bf16_plain": prefix,
    }


def _same_model(name: str, compared_with: dict[str, str]) -> bool:
    """Whether a row decodes the run's model: its chain of references reaches plain (`ntp`), not another
    model's own plain (HF assisted decoding's target, compared with itself)."""
    seen = set()
    while name != PLAIN_MODE and name not in seen:
        seen.add(name)
        name = compared_with.get(name, PLAIN_MODE)
    return name == PLAIN_MODE


HEADLINE = ("gsm8k", "humaneval_first_try", "json", "sql")  # one pass/fail per scored record


def _task_accuracy(records: list[Record]) -> float | None:
    """Share of scored records that pass their task (GSM8K exact match, HumanEval first try, parses)."""
    passed = [r.scores[key] for r in records for key in HEADLINE if key in r.scores]
    return sum(passed) / len(passed) if passed else None


def _mean_scores(records: list[Record]) -> dict[str, dict]:
    """Per task metric: the mean over the records that have it, and how many those are."""
    metrics = sorted({key for r in records for key in r.scores})
    values = {key: [r.scores[key] for r in records if key in r.scores] for key in metrics}
    return {key: {"mean": sum(v) / len(v), "n": len(v)} for key, v in values.items()}


def histogram(accepted: list[int]) -> dict[int, float]:
    """Share of forward passes that emitted each number of tokens."""
    total = max(1, len(accepted))
    return {n: accepted.count(n) / total for n in sorted(set(accepted))}
