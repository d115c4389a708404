"""The training data mix: where the texts to distill on come from, in what shares, and the guarantee that
none of them is evaluation data.

Labels always come from the frozen model (self-distillation), so any text in the model's domain can serve
as context; the mix decides which. `TrainConfig.data` is one source, or a comma list of SOURCE[:ARG]=WEIGHT:

    self[:SET]    the base model's greedy answers to train-split prompts of SET (a prompt set of
                  assets/datasets.py, default mixed; inside a mix write a list with '+': self:gsm8k+humaneval)
    sharegpt      ShareGPT first human turns with their first reply (train split, streamed from the package)
    gsm8k         GSM8K questions with their reference solutions (train split: only GSM8K's test file ships in
                  a package, and `in_split` gives the bench the other half of it)
    humaneval     HumanEval prompts with their canonical solutions (train split, 74 problems)
    jsonl:PATH    rows {"prompt", "response"} (chat formatted) or {"text"}
    text:PATH     a plain-text file, or a folder of .txt files, cut into pieces

    data="self:mixed=0.3,sharegpt=0.5,gsm8k=0.2" data_texts=4000
      -> 1200 own answers, 2000 ShareGPT conversations, 800 GSM8K solutions

Weights are shares of the distinct texts (largest-remainder rounding to data_texts; data_texts=0 means
self_gen_prompts); batches draw texts uniformly, so they are also the shares of the rows trained on. A lone
jsonl/text source keeps all its rows unless data_texts is set. The `self` source goes last in the pool, so
the held-out tail (val_fraction) is the model's own answers: what decoding will produce.

Every text is deduplicated (normalized prompt + response; a user's file keeps the repeats it has on
purpose, but a packaged text equal to one of its rows is dropped) and checked against every eval split
(assets/contamination.py). Packaged sources skip overlapping texts (their train split is ours to choose
from; ShareGPT repeats many prompts under different ids); an explicit eval split, or a user's file that
holds an eval text, is refused with a UserError: nothing is trained on eval data.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from mtplm.errors import UserError

KINDS = {
    "self": "the model's own answers",
    "sharegpt": "ShareGPT conversations",
    "gsm8k": "GSM8K solutions",
    "humaneval": "HumanEval solutions",
    "jsonl": "a JSONL file",
    "text": "a plain-text file or folder",
}
PACKAGED = ("sharegpt", "gsm8k", "humaneval")
FILES = ("jsonl", "text")
EXAMPLE = "self:mixed=0.3,sharegpt=0.5,gsm8k=0.2"


@dataclass(frozen=True)
class Source:
    kind: str  # a KINDS name
    arg: str  # self: prompt set; jsonl / text: path; packaged: the split ("" = train)
    weight: float

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.arg}" if self.arg else self.kind


def parse_mix(spec: str) -> list[Source]:
    """The sources of a data spec (see the module doc); every mistake is one UserError line."""
    spec = spec.strip()
    if not spec:
        raise UserError(
            f"data is empty: give a source (self:mixed, jsonl:PATH, ...) or a mix such as {EXAMPLE}"
        )
    items = [item.strip() for item in spec.split(",")] if "=" in spec else [spec]
    sources = [_parse_item(item, weighted="=" in spec) for item in items]
    names = [s.name for s in sources]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserError(
            f"data: {', '.join(twice)} appears more than once in the mix {spec!r}: give each source once"
        )
    return sources


def _parse_item(item: str, weighted: bool) -> Source:
    body, weight_text = item.rsplit("=", 1) if weighted and "=" in item else (item, "")
    if weighted and not weight_text:
        raise UserError(
            f"data: {item!r} has no weight: write every source of a mix as SOURCE=WEIGHT, e.g. {EXAMPLE}"
        )
    try:
        weight = float(weight_text) if weight_text else 1.0
    except ValueError:
        raise UserError(f"data: the weight of {body!r} must be a number, got {weight_text!r}") from None
    if not weight > 0 or math.isinf(weight):
        raise UserError(f"data: the weight of {body!r} must be a positive number, got {weight_text}")
    kind, _, arg = body.strip().partition(":")
    if kind not in KINDS:
        raise UserError(f"data: unknown source {kind!r}: use one of {', '.join(KINDS)} (e.g. {EXAMPLE})")
    if kind in FILES and not arg:
        raise UserError(f"data: {kind} needs a path: {kind}:PATH")
    if kind in PACKAGED and arg not in ("", "train"):
        if arg in ("eval", "all"):
            raise UserError(
                f"data: {body} would train on the eval split the bench measures on; nothing is "
                f"trained on eval data: use {kind} (its train split)"
            )
        raise UserError(f"data: unknown split {arg!r} of {kind}: only its train split can be trained on")
    if kind == "self":
        arg = arg.replace("+", ",") or "mixed"
    return Source(kind, "" if kind in PACKAGED else arg, weight)


def counts(sources: list[Source], total: int) -> list[int]:
    """Texts per source: the weights' shares of `total`, rounded by largest remainder (they sum to total)."""
    weight = sum(s.weight for s in sources)
    exact = [total * s.weight / weight for s in sources]
    floors = [int(x) for x in exact]
    by_remainder = sorted(range(len(sources)), key=lambda i: floors[i] - exact[i])
    for i in by_remainder[: total - sum(floors)]:
        floors[i] += 1
    return floors


def ordered(sources: list[Source]) -> list[Source]:
    """The pool's source order: `self` last, so the held-out tail is the model's own answers."""
    return sorted(sources, key=lambda s: s.kind == "self")


def packaged_rows(kind: str, seed: int) -> Iterator[dict]:
    """A packaged source's train-split texts as rows, streamed, in a seeded order (ShareGPT: file order)."""
    from mtplm.assets import datasets

    if kind == "sharegpt":
        for example in datasets.sharegpt_conversations("train"):
            yield {"prompt": example.prompt, "response": example.answer, "id": example.id}
        return
    examples = datasets.gsm8k_solutions() if kind == "gsm8k" else datasets.humaneval_solutions()
    chosen = sorted((e for e in examples if datasets.in_split(e.id, "train")), key=lambda e: e.id)
    random.Random(seed).shuffle(chosen)
    for example in chosen:
        answer = example.answer or ""
        if kind == "gsm8k":  # calculator annotations out, the final line as a sentence
            answer = re.sub(r"<<[^>]*>>", "", answer)
            answer = re.sub(r"\n?####\s*(.+)$", r"\nThe answer is \1.", answer.strip())
        yield {"prompt": example.prompt, "response": answer, "id": example.id}


class Pool:
    """Collects the texts of a mix: deduplicated, eval-checked, counted per source."""

    def __init__(self, index) -> None:
        self.index, self.seen, self.report = index, set[str](), list[str]()

    def take(self, source: Source, rows: Iterator[dict], wanted: int | None, to_sample) -> list:
        from mtplm.assets.contamination import normalized

        samples: list = []
        dropped_eval, duplicates, empty = 0, 0, 0
        for number, row in enumerate(rows, 1):
            if wanted is not None and len(samples) >= wanted:
                break
            prompt, response = str(row.get("prompt", "")), str(row.get("response", row.get("text", "")))
            hit = self.index.hit(prompt, response)
            if hit is not None:
                if source.kind in FILES:
                    raise UserError(
                        f"data {source.name}: row {number} overlaps the eval example {hit} (a shared run "
                        "of 13 words, or all of a shorter eval text): remove it; nothing is trained on "
                        "eval data"
                    )
                dropped_eval += 1
                continue
            key = normalized(f"{prompt}\n{response}")
            if key in self.seen and source.kind not in FILES:  # a user's file keeps its own repeats
                duplicates += 1
                continue
            made = to_sample(row, number)
            if not made:
                empty += 1
                continue
            self.seen.add(key)
            samples.extend(made)
        self.report.append(
            f"{source.name}: {len(samples)} texts (skipped {dropped_eval} overlapping an eval split, "
            f"{duplicates} duplicates, {empty} too short)"
        )
        if wanted is not None and len(samples) < wanted and source.kind != "self":
            raise UserError(
                f"data {source.name} gives only {len(samples)} usable texts, the mix asks for {wanted}: "
                "lower its weight or data_texts"
            )
        return samples


def load_mix(spec: str, tokenizer, hf_model, run_dir: Path, cfg, to_sample) -> list:
    """Every sample of the mix `spec`, `self` last (see the module doc). `to_sample(row, number)` makes the
    Samples of one row (data.py)."""
    from mtplm.assets.contamination import eval_index
    from mtplm.train.sources import read_rows, self_generate

    sources = ordered(parse_mix(spec))
    lone_file = len(sources) == 1 and sources[0].kind in FILES and not cfg.data_texts
    wanted: list[int | None] = (
        [None] if lone_file else list(counts(sources, cfg.data_texts or cfg.self_gen_prompts))
    )
    pool = Pool(eval_index())
    samples = []
    for source, n in zip(sources, wanted, strict=True):
        if source.kind == "self":
            assert n is not None  # a count is None only for a lone file
            cache = Path(cfg.self_gen_cache) if cfg.self_gen_cache else run_dir / "selfgen.jsonl"
            rows = iter(self_generate(hf_model, tokenizer, source.arg, n, cfg, cache, pool.index))
        elif source.kind in FILES:
            rows = iter(read_rows(source.kind, Path(source.arg)))
        else:
            rows = packaged_rows(source.kind, cfg.seed)
        for sample in pool.take(source, rows, n, to_sample):
            samples.append(sample.tagged(source.name))
    if len(sources) > 1 or not lone_file:
        tqdm.write("data mix: " + "; ".join(pool.report))
    return samples
