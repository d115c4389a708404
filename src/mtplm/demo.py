"""The main job: answer a few prompts in plain and ConfAdapt mode side by side, with the speedup."""

from __future__ import annotations

from contextlib import nullcontext

from .config import DecodeConfig
from .data import chat_prompt_ids
from .decode import generate
from .errors import UserError
from .model import load_model

PROMPTS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List three tips for staying focused while studying.",
)


def run_demo(spec: str, dtype: str, max_new_tokens: int, tau: float | None) -> None:
    model = load_model(spec, dtype)
    if model.meta is None:
        raise UserError(f"{spec} is not a converted model: the demo compares plain and ConfAdapt decoding, "
                        "so give a checkpoint made by `mtplm train`")
    tok = model.tokenizer
    plain_cfg = DecodeConfig(mode="ntp", max_new_tokens=max_new_tokens)
    fast_cfg = DecodeConfig(mode="confadapt", tau=tau, max_new_tokens=max_new_tokens)
    generate(model, chat_prompt_ids(tok, "Hi"), DecodeConfig(mode="ntp", max_new_tokens=4))  # warm-up
    totals = {"plain": [0, 0.0, 0], "confadapt": [0, 0.0, 0]}
    print(f"model: {spec} ({dtype}); ConfAdapt threshold {tau if tau is not None else model.meta.thresholds['tau']}\n")
    for prompt in PROMPTS:
        ids = chat_prompt_ids(tok, prompt)
        print("=" * 100 + f"\nPROMPT: {prompt}\n")
        for name, cfg in (("plain", plain_cfg), ("confadapt", fast_cfg)):
            with model.pristine() if name == "plain" else nullcontext():
                out = generate(model, ids, DecodeConfig(**vars(cfg)))
            total = totals[name]
            total[0] += len(out.tokens)
            total[1] += out.elapsed_s
            total[2] += out.forwards
            text = tok.decode(out.tokens, skip_special_tokens=True).strip()
            print(f"--- {name}: {out.tokens_per_second:.1f} tokens/s, {out.tokens_per_forward:.2f} tokens/forward\n{text}\n")
    rate = {name: t[0] / max(t[1], 1e-9) for name, t in totals.items()}
    per_forward = {name: t[0] / max(t[2], 1) for name, t in totals.items()}
    print("=" * 100)
    for name in totals:
        print(f"{name:>10}: {rate[name]:6.1f} tokens/s  {per_forward[name]:.2f} tokens/forward")
    print(f"   speedup: {rate['confadapt'] / rate['plain']:.2f}x wall-clock (ConfAdapt over plain, same run)")
