"""Which Python files of mtplm a generated token crosses, and which ones a request's settings cross.

Token: runs `generate` as `mtplm generate` does (the CLI's stream printer on each step) on the shipped
checkpoint and records, with sys.setprofile, every mtplm source file that runs Python code from the second
pass to the end: the steady-state path of a token (CLI printing -> loop -> strategy -> backend -> kernels
-> CLI printing). The first pass (the prompt) and model loading are left out.

Request: the files whose code runs from the CLI's parsed options to the sequence's first plan (the CLI), and
from the HTTP body to the engine's Decoding (the server, in process, with the tiny test model), filtered to
the frames that hold the request (a DecodeConfig, a body or a Job) among their locals.

    python scripts/probes/token_path.py [--mode verified:lookup] [--backend compiled] [--tokens 24]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "mtplm"


class Recorder:
    """Every mtplm file with a Python frame while on (sys.setprofile); `holding` limits it to frames whose
    locals hold such an object when they are called or return."""

    def __init__(self, holding: tuple[type, ...] = ()) -> None:
        self.files: dict[str, set[str]] = {}
        self.on, self.holding = False, holding

    def __call__(self, frame, event, arg) -> None:
        if not self.on or event not in ("call", "return"):
            return
        path = frame.f_code.co_filename
        if not path.startswith(str(PACKAGE)):  # not compiled graphs' code in $MTPLM_HOME, nor this probe
            return
        if self.holding and not any(isinstance(v, self.holding) for v in frame.f_locals.values()):
            return
        name = path[len(str(PACKAGE)) + 1 :]
        self.files.setdefault(name, set()).add(frame.f_code.co_name)

    def report(self, title: str) -> None:
        print(f"{title}: {len(self.files)} Python files")
        for name in sorted(self.files):
            print(f"  {name}: {', '.join(sorted(self.files[name]))}")


def token_path(args) -> None:
    from mtplm.cli.defaults import DEFAULT_CHECKPOINT
    from mtplm.config import parse_mode
    from mtplm.decode.fast.gguf import decode_dtype
    from mtplm.decode.passes.backends import make_backend
    from mtplm.decode.run.loop import generate
    from mtplm.model import load_model
    from mtplm.text import StreamDecoder, chat_prompt_ids

    model = load_model(DEFAULT_CHECKPOINT, decode_dtype(args.dtype, args.backend))
    backend = make_backend(args.backend, model, slots=1)
    ids = chat_prompt_ids(model.tokenizer, "List the planets of the solar system, one per line.")
    cfg = dataclasses.replace(parse_mode(args.mode), max_new_tokens=args.tokens)
    generate(model, ids, cfg, backend=backend)  # warm: caches, kernels built and loaded
    recorder, decoder, passes = Recorder(), StreamDecoder(model.tokenizer), [0]

    def printed(step) -> None:  # as cli/generate.py prints a step
        print(decoder.push(step.tokens), end="", file=sys.stderr)
        passes[0] += 1
        recorder.on = True  # from the end of the first pass on

    sys.setprofile(recorder)
    try:
        generate(model, ids, cfg, on_step=printed, backend=backend)
    finally:
        sys.setprofile(None)
    print(file=sys.stderr)
    recorder.report(f"a token, {args.mode} on the {args.backend} backend, {passes[0]} passes")


def request_path() -> None:
    sys.path.insert(0, str(PACKAGE.parents[1] / "tests"))
    from conftest import tiny_mtp

    from mtplm.cli import _parser
    from mtplm.cli.decode_options import decode_config
    from mtplm.config import DecodeConfig
    from mtplm.decode.passes.backends import describe, make_backend
    from mtplm.decode.run.engine import Engine, Job
    from mtplm.decode.run.loop import generate
    from mtplm.serve.checks import decode_config as body_config
    from mtplm.serve.protocol import CompletionRequest

    model = tiny_mtp(seed=3)
    cli = Recorder((DecodeConfig,))
    sys.setprofile(cli)
    cli.on = True
    args = _parser().parse_args(["generate", "x", "--mode", "ntp", "--max-new-tokens", "4"])
    generate(model, [1, 2, 3], decode_config(args))
    sys.setprofile(None)
    cli.report("max_new_tokens from the CLI's options to the loop (frames holding the DecodeConfig)")

    backend = make_backend("eager", model, 1)
    engine = Engine(model, max_batch=1, backend=backend, start=False)
    served = Recorder((DecodeConfig, CompletionRequest, Job))
    sys.setprofile(served)
    served.on = True
    req = CompletionRequest(model="m", prompt="t1", mode="ntp", max_tokens=4)
    engine.submit(Job([1, 2, 3], body_config(req, describe(model, backend), "ntp", 4), lambda s, e: None))
    sys.setprofile(None)
    served.report("max_tokens from the parsed body to the engine's Decoding (frames holding it)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="verified:lookup")
    parser.add_argument("--backend", default="compiled", help="as generate --backend (default: %(default)s)")
    parser.add_argument("--dtype", default="auto", help="as `mtplm generate --dtype` (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--request-only", action="store_true", help="only the request's path (no model load)")
    args = parser.parse_args()
    request_path()
    if not args.request_only:
        token_path(args)


if __name__ == "__main__":
    main()
