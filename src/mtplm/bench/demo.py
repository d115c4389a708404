"""The main job: answer a few prompts in plain, ConfAdapt and two verified (lossless) modes side by side,
with speedups: mask-slot drafts (`verified`) and drafts copied from the text (`lookup`, the CLI's and
server's default)."""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from functools import partial

from mtplm.config import PLAIN_MODE, DecodeConfig
from mtplm.config.modes import mode_entry
from mtplm.decode.fast.gguf import decode_dtype
from mtplm.decode.passes.backends import make_backend, resolve_backend
from mtplm.decode.run.loop import generate
from mtplm.decode.run.warm import untimed_compiles, warm_up
from mtplm.errors import UserError
from mtplm.model import load_model
from mtplm.text import chat_prompt_ids

PROMPTS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List three tips for staying focused while studying.",
)


def run_demo(
    spec: str, dtype: str, max_new_tokens: int, tau: float | None, backend_name: str = "auto"
) -> None:
    model = load_model(spec, decode_dtype(dtype, backend_name))
    if model.meta is None:
        raise UserError(
            f"{spec} is not a converted model: the demo compares plain, ConfAdapt and verified decoding, "
            "so give a checkpoint made by `mtplm train`"
        )
    tok = model.tokenizer
    modes = {
        "plain": DecodeConfig(mode=PLAIN_MODE, max_new_tokens=max_new_tokens),
        "confadapt": DecodeConfig(mode="confadapt", tau=tau, max_new_tokens=max_new_tokens),
        "verified": DecodeConfig(mode="verified", max_new_tokens=max_new_tokens),
        "lookup": DecodeConfig(mode="verified", drafting="lookup", max_new_tokens=max_new_tokens),
    }
    backend = make_backend(backend_name, model, slots=1)
    prompts = [chat_prompt_ids(tok, prompt) for prompt in PROMPTS]
    _warm(model, backend, modes, prompts, max_new_tokens)
    totals = {name: [0, 0.0, 0] for name in modes}
    identical = {name: 0 for name, cfg in modes.items() if mode_entry(cfg.mode).lossless}
    threshold = tau if tau is not None else model.meta.decode_thresholds().tau
    print(
        f"model: {spec} ({dtype}, {resolve_backend(backend_name, model)} backend); "
        f"ConfAdapt threshold {threshold}\n"
    )
    for prompt, ids in zip(PROMPTS, prompts, strict=True):
        print("=" * 100 + f"\nPROMPT: {prompt}\n")
        for name, cfg in modes.items():  # plain first: the others are compared with its answer
            plain = mode_entry(cfg.mode).plain
            with model.pristine() if plain else nullcontext():
                out = untimed_compiles(partial(generate, model, ids, cfg, backend=backend), backend)
            if plain:
                plain_tokens = out.tokens
            if name in identical:
                identical[name] += out.tokens == plain_tokens
            total = totals[name]
            total[0] += len(out.tokens)
            total[1] += out.elapsed_s
            total[2] += out.forwards
            text = tok.decode(out.tokens, skip_special_tokens=True).strip()
            print(
                f"--- {name}: {out.tokens_per_second:.1f} tokens/s, "
                f"{out.tokens_per_forward:.2f} tokens/forward\n{text}\n"
            )
    _print_totals(totals, identical)


def _warm(model, backend, modes: dict, prompts: list[list[int]], max_new_tokens: int) -> None:
    """Compile every bucket the rows meet, then pay each mode's first-call costs, before any is timed."""
    warm = chat_prompt_ids(model.tokenizer, "Repeat this list three times: red, green, blue, yellow.")
    lengths = [len(ids) for ids in [*prompts, warm]]
    warm_up(
        backend,
        model,
        list(modes.values()),
        (min(lengths), max(lengths)),
        max(max_new_tokens, 48),
        what="the demo",
    )  # every bucket the rows below meet, compiled before any is timed
    for cfg in modes.values():  # warm-up: first-call costs outside the compiled buckets
        generate(model, warm, dataclasses.replace(cfg, max_new_tokens=48), backend=backend)
    backend.seen.clear()  # the drafts' worth is learned on the prompts shown, not on the warm-up's


def _print_totals(totals: dict[str, list], identical: dict[str, int]) -> None:
    """Each mode's rate over all prompts, its speedup over plain, and how often it matched plain."""
    rate = {name: t[0] / max(t[1], 1e-9) for name, t in totals.items()}
    per_forward = {name: t[0] / max(t[2], 1) for name, t in totals.items()}
    print("=" * 100)
    for name in totals:
        print(f"{name:>10}: {rate[name]:6.1f} tokens/s  {per_forward[name]:.2f} tokens/forward")
    for name in list(totals)[1:]:  # the first row is plain decoding
        print(f"   {name} speedup: {rate[name] / rate['plain']:.2f}x wall-clock over plain (same run)")
    for name, same in identical.items():
        print(
            f"   {name} output identical to plain: {same}/{len(PROMPTS)} prompts"
            + (
                " (bf16 rounding differs between one-row and multi-row passes; "
                "in fp32 it is always identical)"
                if same < len(PROMPTS)
                else ""
            )
        )
