"""The bench's outside rows run in this process: Hugging Face `generate` (plain, prompt lookup, assisted
decoding for a larger target) and llama.cpp through llama-cpp-python, each timed on the same prompts.
Each is name -> (run(ids) -> (tokens, seconds), the row it is compared with). llama-server's rows, in
their own processes, are llama_server.py's."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from mtplm.bench import llama_server
from mtplm.config import PLAIN_MODE
from mtplm.errors import UserError


def hf_baselines(args, model, stops: list[int]) -> dict:
    """Hugging Face `generate` runners, each timed on the same prompts: name -> (run, reference mode)."""
    if args.no_hf:
        return {}
    runner = _hf_runner(args.max_new_tokens, stops)

    def pristine(run):  # the base model graph without adapter wrappers, for each call
        def wrapped(ids):
            with model.pristine():
                return run(ids)

        return wrapped

    runs = {"hf-generate": (pristine(runner(model.hf)), PLAIN_MODE)}
    if args.lookup_tokens:
        runs["hf-prompt-lookup"] = (
            pristine(runner(model.hf, prompt_lookup_num_tokens=args.lookup_tokens)),
            PLAIN_MODE,
        )
    if getattr(args, "llama_cpp", False):
        run = llama_cpp_runner(model, args.max_new_tokens, stops)
        if run is not None:
            runs["llama.cpp"] = (run, PLAIN_MODE)
    if args.assisted:
        runs |= _assisted(args, model, runner)
    return runs


def _hf_runner(max_new_tokens: int, stops: list[int]):
    """runner(hf, **extra) -> run(ids): greedy `hf.generate` of one prompt, timed."""

    def runner(hf, **extra):
        def run(ids: list[int]) -> tuple[list[int], float]:
            with torch.inference_mode():
                start = time.perf_counter()
                seq = hf.generate(
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=stops,
                    pad_token_id=stops[0],
                    **extra,
                )
                return seq[0, len(ids) :].tolist(), time.perf_counter() - start

        return run

    return runner


def _assisted(args, model, runner) -> dict:
    """HF assisted decoding: the base of the bench's model drafts for `--assisted`, against its own greedy."""
    from mtplm.model import load_model

    target = load_model(args.assisted, "bf16" if args.dtype in ("auto", "gguf") else args.dtype)
    if target.tokenizer.get_vocab() != {t: i for t, i in model.tokenizer.get_vocab().items() if t != "<mtp>"}:
        raise UserError(
            f"--assisted {args.assisted}: its tokenizer differs from {args.model}'s; assisted "
            "decoding here needs the same vocabulary"
        )
    # the drafter is the unconverted base: the <mtp> row would make its vocabulary one longer than the
    # target's
    base = model.meta.base_model.get("spec") if model.meta else None
    draft = (
        load_model(base, "bf16" if args.dtype in ("auto", "gguf") else args.dtype).hf if base else model.hf
    )
    plain_name = f"hf-generate[{args.assisted}]"
    return {
        plain_name: (runner(target.hf), plain_name),
        f"hf-assisted[{args.assisted}]": (runner(target.hf, assistant_model=draft), plain_name),
    }


def llama_cpp_runner(model, max_new_tokens: int, stops: list[int]):
    """llama.cpp greedy decoding of the GGUF the model was converted from, or None (with a message)."""
    from mtplm.assets.models import SOURCE_FILE

    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama.cpp baseline skipped: llama-cpp-python is not installed (see README: Benchmark)")
        return None
    base = llama_server.base_dir(model) or Path("")
    try:
        gguf = json.loads((base / SOURCE_FILE).read_text())["gguf"]
    except (OSError, ValueError, KeyError):
        print(f"llama.cpp baseline skipped: no GGUF recorded for the base model at {base}")
        return None
    llm = Llama(model_path=gguf, n_ctx=2048, n_threads=torch.get_num_threads(), verbose=False)

    def run(ids: list[int]) -> tuple[list[int], float]:
        llm.reset()
        tokens, start = [], time.perf_counter()
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            tokens.append(int(token))
            if token in stops or len(tokens) >= max_new_tokens:
                break
        return tokens, time.perf_counter() - start

    return run
