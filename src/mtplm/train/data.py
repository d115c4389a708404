"""Training text: prompt/response pairs, plain text, the base model's own answers (self-generation), the
packaged data sets, or a weighted mix of them (mix.py: the spec, the shares, dedup and the eval guard;
sources.py: reading files and self-generating). This module turns rows into Samples and batches.

Data specs (TrainConfig.data), each alone or as SOURCE=WEIGHT in a comma list:
    self:<prompt set>   the base model answers prompts of that set (datasets.prompt_set, 'train' split)
                        greedily, in batches; cached by prompt id in selfgen.jsonl (or self_gen_cache)
    sharegpt | gsm8k | humaneval   the train split of a packaged data set, with its responses
    jsonl:<path>        rows {"prompt": ..., "response": ...} (chat formatted) or {"text": ...}
    text:<path>         a plain-text file (or a folder of .txt files), cut into pieces
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from mtplm.errors import UserError
from mtplm.text import chat_prompt_ids
from mtplm.train.mix import load_mix
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
    eos = tokenizer.eos_token_id

    def to_sample(row: dict, number: int) -> list[Sample]:
        try:
            return _sample(row, tokenizer, eos)
        except (AttributeError, TypeError, ValueError) as exc:  # UserError (an empty prompt) is a ValueError
            raise UserError(
                f"data {spec!r}, row {number}: {exc}; every row needs non-empty text, or a "
                "non-empty prompt and a response"
            ) from None

    samples = load_mix(spec, tokenizer, hf_model, run_dir, cfg, to_sample)
    if not samples:
        raise UserError(
            f"data {spec!r} holds no usable samples: every text or response is shorter than 2 tokens "
            "(zero-length sequences); give rows with some text to learn from"
        )
    return samples


def _sample(row: dict, tokenizer, eos: int) -> list[Sample]:
    """The row as a Sample, or none when it has fewer than 2 tokens to predict."""
    if "text" in row:
        ids = tokenizer(row["text"], add_special_tokens=False)["input_ids"]
        prompt_ids, response_ids = ids[:1], ids[1:]
    else:
        prompt_ids = chat_prompt_ids(tokenizer, row["prompt"])
        response_ids = tokenizer(row["response"], add_special_tokens=False)["input_ids"] + [eos]
    return [Sample(prompt_ids, response_ids)] if len(response_ids) >= 2 else []


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
        if self.index + self.batch_size > len(
            self.order
        ):  # a new epoch; the incomplete last batch is dropped
            self.rng.shuffle(self.order)
            self.index = 0
        chosen = self.order[self.index : self.index + self.batch_size]
        self.index += self.batch_size
        return collate([self.samples[j] for j in chosen], self.seq_len, self.pad_id, chosen)

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate(), "order": list(self.order), "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        if len(state["order"]) != len(self.samples):
            raise UserError(
                f"the saved data position covers {len(state['order'])} samples but the data now "
                f"holds {len(self.samples)}: resume with the data the run started with"
            )
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.order, self.index = list(state["order"]), state["index"]


def row_ids(sample: Sample, seq_len: int) -> tuple[list[int], int]:
    """The token row a sample trains on (prompt tail + response, at most seq_len) and its prompt length."""
    prompt = sample.prompt_ids[-(seq_len // 2) :]  # keep room for the response
    return (prompt + sample.response_ids)[:seq_len], len(prompt)


def collate(samples: list[Sample], seq_len: int, pad_id: int, indices: list[int] | None = None) -> TokenBatch:
    rows, lengths, starts = [], [], []
    for s in samples:
        ids, prompt_len = row_ids(s, seq_len)
        rows.append(ids + [pad_id] * (seq_len - len(ids)))
        lengths.append(len(ids))
        starts.append(max(0, prompt_len - 1))
    width = max(lengths)  # no all-padding columns
    return TokenBatch(
        torch.tensor(rows)[:, :width],
        torch.tensor(lengths),
        torch.tensor(starts),
        None if indices is None else torch.tensor(indices),
    )
