"""The draft budget against feeding every copied draft: plain decoding, `verified:lookup` with every copy fed
(the pass cost unknown) and `verified:lookup` priced by this machine (decode/budget.py), interleaved prompt by
prompt on one compiled backend, on the bench's held-out prompts and on prompts of kinds the bench does not
hold (JSON, SQL, code, open questions, arithmetic). Measures, never asserts.

    python scripts/probes/budget_ab.py --prompts 20 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from mtplm.assets.datasets import prompt_set
from mtplm.config import DecodeConfig, parse_mode
from mtplm.decode.passes.backends import make_backend
from mtplm.decode.run.loop import generate
from mtplm.decode.run.warm import warm_up
from mtplm.decode.strategies import make_strategy
from mtplm.model import load_model
from mtplm.text import chat_prompt_ids

OTHER_KINDS = [
    "Write a JSON object describing a book with title, author, year and a list of three genres.",
    "Give a JSON array of four cities, each with name, country and population.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Write a SQL table definition for employees with id, name, department and salary, then insert two rows.",
    "Write a Python function that checks whether a string is a palindrome, with a docstring and two tests.",
    "Write a Python class Stack with push, pop, peek and is_empty methods.",
    "Write a bash script that counts the lines of every .py file in a folder and prints the total.",
    "Explain why the sky is blue in three short paragraphs.",
    "What are the pros and cons of remote work? Answer as a bulleted list.",
    "Describe how a hash map works to a new programmer.",
    "A train travels 120 km in 1.5 hours, then 80 km in 1 hour. What is its average speed? Show the steps.",
    "Compute 37 * 48 step by step, then check the result by division.",
]


def prompts(model, count: int, other: int, seed: int) -> list[tuple[str, list[int]]]:
    texts = [("bench", e.prompt) for e in prompt_set("mixed", count, seed, split="eval")]
    texts += [("other", text) for text in OTHER_KINDS[:other]]
    return [(kind, chat_prompt_ids(model.tokenizer, text)) for kind, text in texts]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-mtp")
    p.add_argument("--prompts", type=int, default=20, help="bench prompts (the other kinds are added)")
    p.add_argument("--other", type=int, default=len(OTHER_KINDS), help="prompts of the other kinds")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--backend", default="compiled")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    model = load_model(args.model, "bf16")
    backend = make_backend(args.backend, model, slots=1)
    rows = prompts(model, args.prompts, args.other, args.seed)
    lookup = parse_mode("verified:lookup")
    modes = {"plain": DecodeConfig(mode="ntp"), "lookup, every copy": lookup, "lookup, priced": lookup}
    lengths = [len(ids) for _, ids in rows]
    warm_up(backend, model, list(modes.values()), (min(lengths), max(lengths)), args.max_new_tokens)
    curve = backend.pass_cost
    assert curve is not None
    print("row cost here: " + ", ".join(f"c({n})/c(1) {curve(n):.2f}" for n in (2, 3, 4, 5, 8)), flush=True)
    totals = {name: [0, 0.0, 0, 0] for name in modes}

    def free(n: int) -> float:
        return 1.0

    # tokens, seconds, passes, identical
    for _, ids in rows[:2]:  # first-call costs outside any timed row
        for cfg in modes.values():
            generate(model, ids, dataclasses.replace(cfg, max_new_tokens=16), backend=backend)
    began = time.perf_counter()
    for i, (kind, ids) in enumerate(rows):
        plain_tokens: list[int] = []
        for name, cfg in modes.items():
            # every copy: rows priced as free, so each pass feeds all it is offered (the budget's upper end)
            backend.pass_cost = curve if name.endswith("priced") else free
            cfg = dataclasses.replace(cfg, max_new_tokens=args.max_new_tokens)
            out = generate(model, ids, cfg, strategy=make_strategy(cfg, None), backend=backend)
            plain_tokens = out.tokens if name == "plain" else plain_tokens
            t = totals[name]
            t[0] += len(out.tokens)
            t[1] += out.elapsed_s
            t[2] += out.forwards
            t[3] += out.tokens == plain_tokens
        print(f"  prompt {i + 1}/{len(rows)} ({kind}) after {time.perf_counter() - began:.0f} s", flush=True)
    plain_rate = totals["plain"][0] / totals["plain"][1]
    print(f"{len(rows)} prompts, {args.max_new_tokens} new tokens, bf16, {args.backend}")
    print(f"{'mode':<22}{'tokens/s':>10}{'vs plain':>10}{'tokens/pass':>13}{'ms/pass':>9}{'identical':>11}")
    for name, (tokens, seconds, passes, same) in totals.items():
        print(
            f"{name:<22}{tokens / seconds:>10.1f}{tokens / seconds / plain_rate:>9.2f}x"
            f"{tokens / passes:>13.2f}{1e3 * seconds / passes:>9.1f}{same:>6}/{len(rows)}"
        )


if __name__ == "__main__":
    main()
