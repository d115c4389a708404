"""Row invariance of the fast decode pass: does a row's result depend on how many rows share its pass?

Prefills `--context` tokens, then runs row 0 alone (1 row) and as the first of `--rows` rows (the others
any tokens after it, causal), and compares row 0's results bitwise. Uncompiled (`static`), op by op per
layer (norms, qkv, rope, attention, o, mlp), so kernel effects show apart from inductor's fusions; then
the compiled backend's hidden states and logits (1-row bucket: the whole pass as one graph; the others: a
graph per layer).

    python scripts/probes/invariance_probe.py --rows 2,8 --context 100
"""

from __future__ import annotations

import argparse

import torch

from mtplm.decode.fast import forward
from mtplm.decode.passes.backends import make_backend
from mtplm.decode.protocol import Feed
from mtplm.model import load_model, parse_dtype

TRACED = ("rms_norm", "project", "rotate", "attend")


def feed(tokens: list[int]) -> Feed:
    return Feed(tokens, len(tokens), 0, 0, False, None)


def traced_run(backend, tokens: list[int], length: int) -> list[tuple[str, torch.Tensor]]:
    """(op, row 0's output) for every traced op of one uncompiled pass, in call order."""
    record: list[tuple[str, torch.Tensor]] = []
    originals = {name: getattr(forward, name) for name in TRACED}

    def wrap(name):
        def traced(*args, **kwargs):
            out = originals[name](*args, **kwargs)
            label = args[1] if name == "project" else name
            record.append((label, out[0, 0].clone()))
            return out

        return traced

    for name in TRACED:
        setattr(forward, name, wrap(name))
    try:
        hidden = backend.run(0, [feed(tokens)], [length])
    finally:
        for name, fn in originals.items():
            setattr(forward, name, fn)
    record.append(("final", hidden[0, 0].clone()))
    record.append(("logits", backend.head(hidden[0, :1])[0]))
    return record


def first_difference(one, many) -> str:
    for i, ((name, a), (_, b)) in enumerate(zip(one, many, strict=True)):
        if not torch.equal(a, b):
            gap = (a.float() - b.float()).abs().max().item()
            return f"op {i} ({name}, ~layer {i // 9}): max |diff| {gap:.3g}"
    return "none: bitwise equal"


def compare(backend, tokens: list[int], rows: int, length: int) -> tuple[bool, bool, float]:
    """(hidden equal, logits equal, max |logit diff|) of row 0 alone against row 0 of `rows` rows."""
    one = backend.run(0, [feed(tokens[:1])], [length])[0, :1]
    many = backend.run(0, [feed(tokens[:rows])], [length])[0, :1]
    la, lb = backend.head(one), backend.head(many)
    finite = la.isfinite()
    return torch.equal(one, many), torch.equal(la, lb), (la - lb)[finite].abs().max().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-mtp")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--context", type=int, default=100)
    p.add_argument("--rows", default="2,8")
    p.add_argument("--backends", default="static,compiled")
    args = p.parse_args()
    model = load_model(args.model, args.dtype)
    assert model.hf.dtype == parse_dtype(args.dtype)
    prompt = list(range(200, 200 + args.context))
    tokens = [1000 + 37 * i for i in range(32)]
    with torch.inference_mode():
        for name in args.backends.split(","):
            backend = make_backend(name, model, 1)
            backend.run(0, [feed(prompt)], [0])
            for rows in [int(r) for r in args.rows.split(",")]:
                if name == "static":
                    one = traced_run(backend, tokens[:1], args.context)
                    many = traced_run(backend, tokens[:rows], args.context)
                    print(f"{name} 1 vs {rows} rows: first difference {first_difference(one, many)}")
                hidden, logits, gap = compare(backend, tokens, rows, args.context)
                same = f"hidden equal {hidden}, logits equal {logits} (max |diff| {gap:.3g})"
                print(f"{name} 1 vs {rows} rows: {same}")


if __name__ == "__main__":
    main()
