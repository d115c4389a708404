"""Training text: prompt/response pairs, plain text, the base model's own answers (self-generation), the
packaged data sets, or a weighted mix of them (mix.py: the spec, the shares, dedup and the eval guard).

Data specs (TrainConfig.data), each alone or as SOURCE=WEIGHT in a comma list:
    self:<prompt set>   the base model answers prompts of that set (datasets.prompt_set, 'train' split)
                        greedily, in batches; cached by prompt id in selfgen.jsonl (or self_gen_cache)
    sharegpt | gsm8k | humaneval   the train split of a packaged data set, with its responses
    jsonl:<path>        rows {"prompt": ..., "response": ...} (chat formatted) or {"text": ...}
    text:<path>         a plain-text file (or a folder of .txt files), cut into pieces
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from mtplm.errors import UserError
from mtplm.text import chat_prompt_ids
from mtplm.train.slots import TokenBatch


@dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]  # chat-formatted prompt (empty for plain text)
    response_ids: list[int]  # the text to learn to predict, ending with EOS
    source: str = ""  # the mix source it came from (mix.Source.name)

    def tagged(self, source: str) -> Sample:
        return dataclasses.replace(self, source=source)


def load_samples(spec: str, tokenizer, hf_model, run_dir: Path, cfg) -> list[Sample]:
    """The training (and held-out) samples of `spec`, in pool order: `self` last (mix.py)."""
    from mtplm.train.mix import load_mix

    eos = tokenizer.eos_token_id

    def to_sample(row: dict, number: int) -> list[Sample]:
        try:
            return _sample(row, tokenizer, eos)
        except (AttributeError, TypeError, ValueError) as exc:  # UserError (an empty prompt) is a ValueError
            raise UserError(f"data {spec!r}, row {number}: {exc}; every row needs non-empty text, or a "
                            "non-empty prompt and a response") from None

    samples = load_mix(spec, tokenizer, hf_model, run_dir, cfg, to_sample)
    if not samples:
        raise UserError(f"data {spec!r} holds no usable samples: every text or response is shorter than 2 tokens "
                        "(zero-length sequences); give rows with some text to learn from")
    return samples


def read_rows(kind: str, path: Path) -> list[dict]:
    """The rows of a user's file: jsonl rows as they are, text cut into {"text": piece} rows."""
    if kind == "jsonl":
        return _read_jsonl(path)
    return [{"text": piece} for piece in _read_text(path)]


def _sample(row: dict, tokenizer, eos: int) -> list[Sample]:
    """The row as a Sample, or none when it has fewer than 2 tokens to predict."""
    if "text" in row:
        ids = tokenizer(row["text"], add_special_tokens=False)["input_ids"]
        prompt_ids, response_ids = ids[:1], ids[1:]
    else:
        prompt_ids = chat_prompt_ids(tokenizer, row["prompt"])
        response_ids = tokenizer(row["response"], add_special_tokens=False)["input_ids"] + [eos]
    return [Sample(prompt_ids, response_ids)] if len(response_ids) >= 2 else []


def self_generate(hf_model, tokenizer, prompt_set_name: str, n: int, cfg, cache_file: Path,
                  index=None) -> list[dict]:
    """The base model's greedy answers to n training prompts of a prompt set, in the set's order.

    Answers are cached by prompt id (resumable, and shared by runs that name the same cache file);
    prompts that overlap an eval split (`index`, contamination.EvalIndex) are never answered.
    """
    from mtplm.assets.datasets import prompt_set

    done = {row.get("id"): row for row in _read_cache(cache_file)}
    examples = [e for e in prompt_set(prompt_set_name, n, cfg.seed, split="train")
                if index is None or index.hit(e.prompt) is None]
    todo = [e for e in examples if e.id not in done]
    if todo:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        with open(cache_file, "a") as sink, _answerer(hf_model, tokenizer, cfg) as (answer, step), \
                tqdm(total=len(examples), initial=len(examples) - len(todo), desc="self-generate",
                     unit="prompt") as bar:
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
    """(answer(chunk) -> greedy answer texts, chunk size) for the configured engine (cfg.self_gen_engine). The
    server is sent 8 batches at a time, so its slots refill as answers end instead of waiting for the longest."""
    if cfg.self_gen_engine == "hf":
        yield (lambda chunk: _answer(hf_model, tokenizer, chunk, cfg)), cfg.self_gen_batch
        return
    from mtplm.bench.llama_server import LlamaServer, f16_gguf

    base = Path(getattr(hf_model, "name_or_path", "") or ".")
    if not (base / "config.json").is_file():
        raise UserError("self_gen_engine=llama-server needs a model installed as a local HF directory "
                        f"(got {str(base)!r}); use self_gen_engine=hf")
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
        out = hf_model.generate(ids, attention_mask=attention, max_new_tokens=cfg.self_gen_max_new_tokens,
                                do_sample=False, pad_token_id=pad)
    return [tokenizer.decode(row, skip_special_tokens=True) for row in out[:, width:]]


class BatchStream:
    """Endless shuffled batches; each row = prompt tail + response, truncated to seq_len.

    Its position (shuffle RNG, current order, index) is part of a training checkpoint, so a resumed run
    draws exactly the batches the uninterrupted run would have drawn.
    """

    def __init__(self, samples: list[Sample], batch_size: int, seq_len: int, pad_id: int, seed: int) -> None:
        self.samples, self.batch_size, self.seq_len, self.pad_id = samples, batch_size, seq_len, pad_id
        self.rng = random.Random(seed)
        self.order = list(range(len(samples)))
        self.index = len(samples)  # past the end: the first batch shuffles

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> TokenBatch:
        if self.index + self.batch_size > len(self.order):  # a new epoch; the incomplete last batch is dropped
            self.rng.shuffle(self.order)
            self.index = 0
        chosen = self.order[self.index : self.index + self.batch_size]
        self.index += self.batch_size
        return collate([self.samples[j] for j in chosen], self.seq_len, self.pad_id, chosen)

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate(), "order": list(self.order), "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        if len(state["order"]) != len(self.samples):
            raise UserError(f"the saved data position covers {len(state['order'])} samples but the data now "
                            f"holds {len(self.samples)}: resume with the data the run started with")
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.order, self.index = list(state["order"]), state["index"]


def row_ids(sample: Sample, seq_len: int) -> tuple[list[int], int]:
    """The token row a sample trains on (prompt tail + response, at most seq_len) and its prompt length."""
    prompt = sample.prompt_ids[-(seq_len // 2):]  # keep room for the response
    return (prompt + sample.response_ids)[:seq_len], len(prompt)


def collate(samples: list[Sample], seq_len: int, pad_id: int, indices: list[int] | None = None) -> TokenBatch:
    rows, lengths, starts = [], [], []
    for s in samples:
        ids, prompt_len = row_ids(s, seq_len)
        rows.append(ids + [pad_id] * (seq_len - len(ids)))
        lengths.append(len(ids))
        starts.append(max(0, prompt_len - 1))
    width = max(lengths)  # no all-padding columns
    return TokenBatch(torch.tensor(rows)[:, :width], torch.tensor(lengths), torch.tensor(starts),
                      None if indices is None else torch.tensor(indices))


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
