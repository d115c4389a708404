"""Where training rows come from: the user's files (jsonl rows, plain text cut into pieces) and the base
model's own answers to a prompt set (self-generation, cached in selfgen.jsonl), answered by Hugging Face
`generate` or by llama.cpp's llama-server. mix.py draws its sources' rows from here; data.py makes Samples."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from mtplm.errors import UserError
from mtplm.text import chat_prompt_ids


def read_rows(kind: str, path: Path) -> list[dict]:
    """The rows of a user's file: jsonl rows as they are, text cut into {"text": piece} rows."""
    if kind == "jsonl":
        return _read_jsonl(path)
    return [{"text": piece} for piece in _read_text(path)]


def self_generate(
    hf_model, tokenizer, prompt_set_name: str, n: int, cfg, cache_file: Path, index=None
) -> list[dict]:
    """The base model's greedy answers to n training prompts of a prompt set, in the set's order.

    Answers are cached by prompt id (resumable, and shared by runs that name the same cache file);
    prompts that overlap an eval split (`index`, contamination.EvalIndex) are never answered.
    """
    from mtplm.assets.datasets import prompt_set

    done = {row.get("id"): row for row in _read_cache(cache_file)}
    examples = [
        e
        for e in prompt_set(prompt_set_name, n, cfg.seed, split="train")
        if index is None or index.hit(e.prompt) is None
    ]
    todo = [e for e in examples if e.id not in done]
    if todo:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        with (
            open(cache_file, "a") as sink,
            _answerer(hf_model, tokenizer, cfg) as (answer, step),
            tqdm(
                total=len(examples), initial=len(examples) - len(todo), desc="self-generate", unit="prompt"
            ) as bar,
        ):
            for i in range(0, len(todo), step):
                chunk = todo[i : i + step]
                for example, text in zip(chunk, answer(chunk), strict=True):
                    record = {"prompt": example.prompt, "response": text, "id": example.id}
                    sink.write(json.dumps(record) + "\n")
                    done[example.id] = record
                sink.flush()
                bar.update(len(chunk))
    return [done[e.id] for e in examples]


def _read_cache(cache_file: Path) -> list[dict]:
    """The cached answers. A run killed while appending can leave its last line torn: that line is dropped
    (and the file rewritten without it, so the next answer starts on a line of its own); any other bad line
    is an error."""
    if not cache_file.exists():
        return []
    lines = _lines(cache_file)
    if lines and not _parses(lines[-1]):
        from mtplm.files import atomic_file

        lines = lines[:-1]
        atomic_file(cache_file, lambda tmp: tmp.write_text("".join(line + "\n" for line in lines)))
    return _rows(cache_file, lines)


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return not line.strip()  # a blank line is harmless
    return True


def _prompt(tokenizer, example, cfg) -> list[int]:
    return chat_prompt_ids(tokenizer, example.prompt)[-cfg.seq_len // 2 :]


@contextmanager
def _answerer(hf_model, tokenizer, cfg) -> Iterator:
    """(answer(chunk) -> greedy answer texts, chunk size) for the configured engine (cfg.self_gen_engine).
    The server is sent 8 batches at a time, so its slots refill as answers end instead of waiting for the
    longest."""
    if cfg.self_gen_engine == "hf":
        yield (lambda chunk: _answer(hf_model, tokenizer, chunk, cfg)), cfg.self_gen_batch
        return
    from mtplm.llamacpp.server import LlamaServer, f16_gguf

    base = Path(getattr(hf_model, "name_or_path", "") or ".")
    if not (base / "config.json").is_file():
        raise UserError(
            "self_gen_engine=llama-server needs a model installed as a local HF directory "
            f"(got {str(base)!r}); use self_gen_engine=hf"
        )
    slots, width = cfg.self_gen_batch, cfg.seq_len // 2 + cfg.self_gen_max_new_tokens
    stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    pool = ThreadPoolExecutor(slots)
    with LlamaServer(f16_gguf(base), torch.get_num_threads(), slots * width, parallel=slots) as server:

        def answer(chunk: list) -> list[str]:
            ids = [_prompt(tokenizer, e, cfg) for e in chunk]
            outs = pool.map(lambda p: server.complete(p, cfg.self_gen_max_new_tokens, stops).tokens, ids)
            return [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in outs]

        try:
            yield answer, 8 * slots
        finally:  # on a stop, queued prompts are dropped and the server's exit ends those in flight
            pool.shutdown(wait=False, cancel_futures=True)


def _answer(hf_model, tokenizer, chunk: list, cfg) -> list[str]:
    """Greedy answers to one batch of prompts (left-padded, batched `generate`)."""
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = [_prompt(tokenizer, e, cfg) for e in chunk]
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf_model.generate(
            ids,
            attention_mask=attention,
            max_new_tokens=cfg.self_gen_max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    return [tokenizer.decode(row, skip_special_tokens=True) for row in out[:, width:]]


def _read_jsonl(path: Path) -> list[dict]:
    return _rows(path, _lines(path))


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read training data {path}: {exc}") from None


def _rows(path: Path, lines: list[str]) -> list[dict]:
    """The rows of a JSONL file's lines, each checked for the keys training reads."""
    try:
        rows = [json.loads(line) for line in lines if line.strip()]
    except ValueError as exc:
        raise UserError(f"cannot read training data {path}: {exc}") from None
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not ("text" in row or {"prompt", "response"} <= row.keys()):
            raise UserError(f"{path} line {i + 1}: expected {{'prompt','response'}} or {{'text'}} keys")
    return rows


def _read_text(path: Path, piece_chars: int = 1500) -> list[str]:
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    try:
        text = "\n".join(f.read_text(errors="replace") for f in files)
    except OSError as exc:
        raise UserError(f"cannot read training text {path}: {exc}") from None
    if not text.strip():
        raise UserError(f"training text {path} is empty")
    return [text[i : i + piece_chars] for i in range(0, len(text), piece_chars)]
