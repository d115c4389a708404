"""The constrained structured bench (`mtplm bench --prompt-set structured --constrained`,
scripts/probes/structured_bench.py): every mode with and without each case's constraint
(bench/structured_set.py), per row the share of answers that validate, tokens per pass split into forced and
model-chosen tokens, speed, the grammar's share of a pass, and speed against plain constrained decoding.

Cases run interleaved (case 1 in every row, then case 2, ...) after one untimed warm-up generation per row,
so machine noise spreads over the rows. On a compiled backend every bucket the rows can meet is compiled
first (decode/run/warm.py) and a generation that compiled anyway is timed again, so no compile is timed.
Measures, never asserts.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import asdict
from functools import partial
from pathlib import Path

from mtplm.bench.structured_set import CASES, Case, spec_of, valid
from mtplm.config import PLAIN_MODE

# constrained plain decoding spending a pass on every token, forced ones too (no jump-forward): what a
# constrained server without jump-forward does
NO_JUMP = "ntp no-jump-forward"
# mask() runs inside masks_along and mask_chain; none of these calls another
_ENGINE_CALLS = ("masks_along", "mask_chain", "forced", "forced_after", "finishes", "accepts", "advance")


def _clocked(method, spent: list[float]):
    """`method`, adding the seconds each call takes to spent[0]."""

    def wrapper(*args, **kwargs):
        began = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - began

    return wrapper


@contextmanager
def grammar_clock():
    """Seconds spent in the grammar engine's calls while the block runs (a one-item list, read after)."""
    from mtplm.decode.constraints import constraint as constraint_module

    spent = [0.0]
    originals = {name: getattr(constraint_module.Constraint, name) for name in _ENGINE_CALLS}

    for name, method in originals.items():
        setattr(constraint_module.Constraint, name, _clocked(method, spent))
    try:
        yield spent
    finally:
        for name, method in originals.items():
            setattr(constraint_module.Constraint, name, method)


@contextmanager
def model_clock(runner):
    """Seconds spent in `runner`'s passes and LM head while the block runs (a one-item list, read after):
    the rest of a generation's time is the host's (the loop, strategies, the grammar)."""
    spent = [0.0]

    runner.run, runner.head = (
        _clocked(runner.run, spent),
        _clocked(runner.head, spent),
    )  # instance attributes over the class's
    try:
        yield spent
    finally:
        del runner.run, runner.head


def compile_ms(model, cases: list[Case]) -> dict[str, float]:
    """Each case's grammar compile time (ms), uncached (the tokenizer's engine view is built before)."""
    from mtplm.decode.constraints.constraint import Grammar, _ll_tokenizer
    from mtplm.decode.run.loop import stop_ids

    stops = frozenset(stop_ids(model))
    engine_tokenizer = _ll_tokenizer(model.tokenizer, stops)
    out = {}
    for case in cases:
        began = time.perf_counter()
        Grammar(spec_of(case), engine_tokenizer, stops, len(model.tokenizer))
        out[case.name] = round(1e3 * (time.perf_counter() - began), 2)
    return out


def run_structured(
    model, modes: list, max_new_tokens: int, cases: list[Case] | None = None, backend: str = "eager"
) -> dict:
    """Rows for every (mode, constrained) pair over `cases` (default: the whole set) on `backend` (a name,
    `auto` as the product resolves it); `modes` is a list of (name, DecodeConfig) with plain decoding
    (PLAIN_MODE) among them."""
    from mtplm.decode.constraints.constraint import compile
    from mtplm.decode.passes.backends import make_backend, resolve_backend
    from mtplm.decode.run.loop import generate, stop_ids
    from mtplm.decode.run.warm import untimed_compiles, warm_up
    from mtplm.text import chat_prompt_ids

    cases = list(cases or CASES)
    stops = stop_ids(model)
    grammars = [compile(spec_of(case), model.tokenizer, stops) for case in cases]
    prompts = [chat_prompt_ids(model.tokenizer, case.prompt) for case in cases]
    rows = [(name, _with_limit(cfg, max_new_tokens), c) for name, cfg in modes for c in (False, True)]
    rows += [(NO_JUMP, cfg, True) for name, cfg, c in rows if name == PLAIN_MODE and c]  # the baseline
    totals = {(name, c): _empty() for name, _, c in rows}
    answers: dict = {(name, c): [] for name, _, c in rows}
    runner = make_backend(backend, model, slots=1)
    lengths = (min(map(len, prompts)), max(map(len, prompts)))
    warm_up(runner, model, [cfg for _, cfg, _ in rows], lengths, max_new_tokens, what="the structured set")
    for _name, cfg, c in rows:  # warm-up, untimed
        generate(model, prompts[0], cfg, backend=runner, constraint=grammars[0].start() if c else None)
    for case, ids, grammar in zip(cases, prompts, grammars, strict=True):
        for name, cfg, c in rows:
            run = partial(_timed, model, ids, cfg, runner, grammar if c else None, name != NO_JUMP)
            out, spent = untimed_compiles(run, runner)
            text = model.tokenizer.decode(out.tokens, skip_special_tokens=True)
            ok = valid(case, text, grammar, model.tokenizer)
            _add(totals[(name, c)], out, ok, *spent)
            counts = {"tokens": len(out.tokens), "forced": out.forced, "passes": out.forwards}
            answers[(name, c)].append(
                {"case": case.name, "valid": ok, "text": text, **counts, "seconds": round(out.elapsed_s, 4)}
            )
    # lossless modes write plain decoding's answer under the same constraint
    for (name, c), written in answers.items():
        reference = answers.get((PLAIN_MODE, c))
        if reference is not None:
            totals[(name, c)]["identical"] = sum(
                a["text"] == b["text"] for a, b in zip(written, reference, strict=True)
            )
    plain = totals.get((PLAIN_MODE, True)), totals.get((PLAIN_MODE, False))
    table = [_row(name, c, totals[(name, c)], *plain) for name, _, c in rows]
    return {
        "rows": table,
        "backend": resolve_backend(backend, model),
        "compile_ms": compile_ms(model, cases),
        "cases": [asdict(case) for case in cases],
        "answers": {f"{name}|{'constrained' if c else 'free'}": a for (name, c), a in answers.items()},
    }


def _timed(model, ids: list[int], cfg, runner, grammar, jump: bool = True) -> tuple:
    """One generation on `runner` (under `grammar` unless None, with jump-forward unless `jump` is False)
    and the grammar engine's seconds in it."""
    from mtplm.decode.run.loop import generate

    constraint = grammar.start(jump_forward=jump) if grammar else None
    with grammar_clock() as spent, model_clock(runner) as passes:
        out = generate(model, ids, cfg, backend=runner, constraint=constraint)
    return out, (spent[0], passes[0])


def _with_limit(cfg, max_new_tokens: int):
    from mtplm.config import DecodeConfig

    return DecodeConfig(**{**asdict(cfg), "max_new_tokens": max_new_tokens}).validate()


def _empty() -> dict:
    return {
        "valid": 0,
        "cases": 0,
        "tokens": 0,
        "forced": 0,
        "passes": 0,
        "seconds": 0.0,
        "grammar_s": 0.0,
        "model_s": 0.0,
    }


def _add(total: dict, out, ok: bool, grammar_s: float, model_s: float) -> None:
    total["valid"] += ok
    total["cases"] += 1
    total["tokens"] += len(out.tokens)
    total["forced"] += out.forced
    total["passes"] += out.forwards
    total["seconds"] += out.elapsed_s
    total["grammar_s"] += grammar_s
    total["model_s"] += model_s


def _rate(t: dict | None) -> float | None:
    return t["tokens"] / max(1e-9, t["seconds"]) if t else None


def _row(name: str, constrained: bool, t: dict, plain: dict | None, free: dict | None = None) -> dict:
    """One row; `plain` and `free` are constrained and unconstrained plain decoding's totals (unconstrained
    plain spends a pass on every token: what constrained decoding costs without jump-forward)."""
    passes, rate = max(1, t["passes"]), t["tokens"] / max(1e-9, t["seconds"])
    plain_rate, free_rate = _rate(plain), _rate(free)
    return {
        "mode": name,
        "constrained": constrained,
        "valid": f"{t['valid']}/{t['cases']}",
        "valid_share": round(t["valid"] / max(1, t["cases"]), 3),
        "identical": f"{t['identical']}/{t['cases']}" if "identical" in t else None,
        "tokens_per_pass": round(t["tokens"] / passes, 2),
        "forced_per_pass": round(t["forced"] / passes, 2),
        "model_per_pass": round((t["tokens"] - t["forced"]) / passes, 2),
        "tokens": t["tokens"],
        "tokens_per_s": round(rate, 1),
        "ms_per_pass": round(1e3 * t["seconds"] / passes, 2),
        "grammar_ms_per_pass": round(1e3 * t["grammar_s"] / passes, 3),
        "host_ms_per_pass": round(1e3 * (t["seconds"] - t["model_s"]) / passes, 2),
        "vs_constrained_plain": round(rate / plain_rate, 2) if plain_rate else None,
        "vs_free_plain": round(rate / free_rate, 2) if free_rate else None,
    }


def markdown(rows: list[dict]) -> str:
    head = (
        "| mode | constraint | valid | identical to plain | tokens/pass (forced + model) | tokens/s "
        "| ms/pass | host ms/pass | grammar ms/pass | vs constrained plain | vs free plain |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        same = r.get("identical") or "–"
        lines.append(
            f"| {r['mode']} | {'on' if r['constrained'] else 'off'} | {r['valid']} | {same} "
            f"| {r['tokens_per_pass']} "
            f"({r['forced_per_pass']} + {r['model_per_pass']}) | {r['tokens_per_s']} | {r['ms_per_pass']} "
            f"| {r['host_ms_per_pass']} | {r['grammar_ms_per_pass']} | {r['vs_constrained_plain']}x "
            f"| {r.get('vs_free_plain')}x |"
        )
    return "\n".join(lines)


def run_structured_bench(args, modes: list, model) -> dict:
    """`mtplm bench --constrained`: the rows over the set's first --prompts cases, written to
    --out/structured.json and structured.md and printed."""
    from mtplm.bench.machine import machine

    cases = CASES[: max(1, args.prompts)]
    report = run_structured(model, modes, args.max_new_tokens, cases, args.backend)
    report = {
        "command": "mtplm bench " + " ".join(getattr(args, "argv", [])),
        "model": args.model,
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "machine": machine(),
        **report,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured.json").write_text(json.dumps(report, indent=2))
    table = markdown(report["rows"])
    (out / "structured.md").write_text(f"`{report['command']}`\n\n{table}\n")
    print(table)
    print(f"\nreport: {out / 'structured.md'}")
    return report
