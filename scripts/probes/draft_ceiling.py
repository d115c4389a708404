"""How fast copied drafts could make the default mode at a given price of extra rows: plain greedy answers
replayed offline under each draft policy, with each kind of offer fed its best fixed count.

Plain answers of `--prompts` prompts of `--split` (train by default: not the bench's eval prompts) are
decoded once and kept in `--answers` (reused when it exists). Each policy then drafts at every answer
position; a pass feeds min(offer, cap[kind]) drafts, keeps the run that matches the answer, and costs
1 + row_cost x (drafts) one-row passes; the caps per kind are searched coordinate by coordinate for the most
tokens per cost, an upper bound on what the budget (decode/budget.py) learns online. Policies: the latest
earlier match of the text's last n <= 3 tokens (lookup.py, the default), n <= 5, and either beside a store
of the earlier answers (a cross-request cache, as vLLM's suffix decoding keeps).

    python scripts/probes/draft_ceiling.py --model smollm2-135m-mtp --prompts 100 --max-new-tokens 256 \\
        --row-costs 0.25,0.15,0.10
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path

Offer = tuple[list[int], int]  # (drafts, kind)


class Latest:
    """The tokens after the latest earlier occurrence of the text's last n tokens, longest n first."""

    def __init__(self, longest: int, store: Latest | None = None) -> None:
        self.longest, self.store = longest, store
        self.text: list[int] = []
        self.starts: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.text.append(token)
            i = len(self.text)
            for n in range(1, min(self.longest, i - 1) + 1):
                self.starts[tuple(self.text[i - 1 - n : i - 1])] = i - 1

    def offer(self, most: int) -> Offer:
        for n in range(min(self.longest, len(self.text) - 1), 0, -1):
            start = self.starts.get(tuple(self.text[len(self.text) - n :]))
            if start is not None:
                return self.text[start : start + most], n
        return [], 0

    def shared(self, most: int) -> Offer:
        """This text's own match, else a longer one of 2 tokens or more in the store: kind 10 + n."""
        own, n = self.offer(most)
        if self.store is not None:
            for m in range(min(self.longest, len(self.text)), max(n, 1), -1):
                start = self.store.starts.get(tuple(self.text[len(self.text) - m :]))
                if start is not None:
                    return self.store.text[start : start + most], 10 + m
        return own, n


def offers(answers: list[dict], longest: int, shared: bool) -> list[list[Offer]]:
    """Every answer position's offer (16 drafts at most), the answers in order."""
    store = Latest(longest) if shared else None
    table = []
    for answer in answers:
        text = Latest(longest, store)
        text.extend(answer["prompt"])
        rows = []
        for token in answer["answer"]:
            rows.append(text.shared(16))
            text.extend([token])
        table.append(rows)
        if store is not None:
            store.extend([-1, *answer["answer"]])
    return table


def replay(
    answers: list[dict], table: list[list[Offer]], caps: dict[int, int], row: float
) -> tuple[float, float]:
    """(tokens per pass, tokens per one-row-pass cost) feeding min(offer, caps[kind]) drafts a pass."""
    tokens = passes = cost = 0.0
    for answer, rows in zip(answers, table, strict=True):
        truth, at = answer["answer"], 0
        while at < len(truth):
            drafts, kind = rows[at]
            drafts = drafts[: caps.get(kind, 0)]
            kept = 0
            while kept < len(drafts) and at + kept < len(truth) and drafts[kept] == truth[at + kept]:
                kept += 1
            step = min(kept + 1, len(truth) - at)
            at, tokens, passes, cost = at + step, tokens + step, passes + 1, cost + 1 + row * len(drafts)
    return tokens / passes, tokens / cost


def best_caps(answers: list[dict], table: list[list[Offer]], row: float) -> tuple[float, float, dict]:
    kinds = sorted({kind for rows in table for _, kind in rows if kind})
    caps = dict.fromkeys(kinds, 3)
    for _ in range(3):
        for kind in kinds:
            caps[kind] = max(range(9), key=lambda c: replay(answers, table, {**caps, kind: c}, row)[1])
    return (*replay(answers, table, caps, row), caps)


def plain_answers(args) -> list[dict]:
    path = Path(args.answers)
    if path.exists():
        return [json.loads(line) for line in path.read_text().splitlines()]
    from mtplm.assets.datasets import prompt_set
    from mtplm.config import parse_mode
    from mtplm.decode.fast.gguf import decode_dtype
    from mtplm.decode.passes.backends import make_backend
    from mtplm.decode.run.loop import generate
    from mtplm.model import load_model
    from mtplm.text import eval_prompt_ids

    model = load_model(args.model, decode_dtype("auto", "auto"))
    backend = make_backend("auto", model, slots=1)
    cfg = dataclasses.replace(parse_mode("ntp"), max_new_tokens=args.max_new_tokens)
    answers = []
    for example in prompt_set("mixed", args.prompts, args.seed, split=args.split):
        ids = eval_prompt_ids(model.tokenizer, example.prompt)
        answers.append({"prompt": ids, "answer": generate(model, ids, cfg, backend=backend).tokens})
    path.write_text("".join(json.dumps(answer) + "\n" for answer in answers))
    return answers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-mtp")
    p.add_argument("--split", default="train")
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--prompts", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--answers", default="draft_ceiling_answers.jsonl", help="plain answers, made once")
    p.add_argument("--row-costs", default="0.25,0.15,0.10", help="one extra row's cost over a one-row pass")
    args = p.parse_args()
    answers = plain_answers(args)
    policies: dict[str, Callable[[], list[list[Offer]]]] = {
        "lookup n<=3 (default)": lambda: offers(answers, 3, False),
        "lookup n<=5": lambda: offers(answers, 5, False),
        "n<=3 + earlier answers": lambda: offers(answers, 3, True),
        "n<=5 + earlier answers": lambda: offers(answers, 5, True),
    }
    tables = {name: make() for name, make in policies.items()}
    print(f"{len(answers)} plain answers of {args.model}; vs plain, each kind fed its best fixed count")
    for row in (float(cost) for cost in args.row_costs.split(",")):
        for name, table in tables.items():
            per_pass, speed = best_caps(answers, table, row)[:2]
            print(f"  extra row +{row:.2f}: {name:<24} {per_pass:.2f} tokens/pass, {speed:.3f}x plain")


if __name__ == "__main__":
    main()
