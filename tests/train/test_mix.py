"""The training data mix: weights honoured, deduplication, bad input as one line and exit 2, and nothing from
an eval split ever reaching training."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
from conftest import tiny_tokenizer
from synthetic import write_rows

from mtplm.assets.contamination import EvalIndex, eval_index, normalized
from mtplm.assets.datasets import gsm8k, in_split, prompt_set
from mtplm.cli import main
from mtplm.config import TrainConfig
from mtplm.errors import UserError
from mtplm.train.checks import check_train_config
from mtplm.train.data import BatchStream, load_samples
from mtplm.train.mix import Pool, Source, counts, packaged_rows, parse_mix
from mtplm.train.sources import self_generate


def _unique_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt": f"t{i % 50} t{seed}", "response": " ".join(f"t{rng.randrange(60)}" for _ in range(8))}
        for i in range(n)
    ]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", "data is empty"),
        ("  ", "data is empty"),
        ("self:mixed=0.5,sharegpt=0", "must be a positive number"),
        ("self:mixed=0.5,sharegpt=-1", "must be a positive number"),
        ("self:mixed=0.5,sharegpt=nan", "must be a positive number"),
        ("self:mixed=0.5,sharegpt=x", "must be a number"),
        ("self:mixed=0.5,wikipedia=0.5", "unknown source 'wikipedia'"),
        ("gsm8k:eval=1", "eval split"),
        ("sharegpt:all=0.3,self:mixed=0.7", "eval split"),
        ("self:mixed=0.5,sharegpt", "has no weight"),
        ("gsm8k=0.5,gsm8k=0.5", "more than once"),
        ("jsonl:=1", "needs a path"),
    ],
)
def test_bad_mixes_are_one_clear_error(spec, message):
    with pytest.raises(UserError, match=message):
        parse_mix(spec)
    with pytest.raises(UserError, match=message):
        check_train_config(TrainConfig(data=spec))


@pytest.mark.parametrize("spec", ["", "self:mixed=0", "wiki=1", "gsm8k:eval=1"])
def test_cli_refuses_a_bad_mix_with_one_line_and_exit_2(spec, capsys, tmp_path):
    assert main(["train", f"data={spec}", f"out={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mtplm train: error: data") and "\n" not in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())  # refused before anything was loaded or written


def test_a_lone_source_keeps_the_old_spec_and_a_mix_parses_every_kind():
    assert parse_mix("self:mixed") == [Source("self", "mixed", 1.0)]
    assert parse_mix("jsonl:/data/rows.jsonl") == [Source("jsonl", "/data/rows.jsonl", 1.0)]
    mix = parse_mix("self:gsm8k+humaneval=0.3, sharegpt=0.5, gsm8k:train=0.2")
    assert mix == [
        Source("self", "gsm8k,humaneval", 0.3),
        Source("sharegpt", "", 0.5),
        Source("gsm8k", "", 0.2),
    ]


def test_counts_follow_the_weights_and_sum_to_the_total():
    sources = parse_mix("self:mixed=0.3,sharegpt=0.5,gsm8k=0.2")
    assert counts(sources, 4000) == [1200, 2000, 800]
    assert sum(counts(sources, 7)) == 7
    assert counts(parse_mix("jsonl:a=1,jsonl:b=2"), 10) == [3, 7]


def test_mix_weights_are_honoured_in_the_pool_and_in_the_batches(tmp_path):
    a = write_rows(tmp_path / "a.jsonl", _unique_rows(200, seed=1))
    b = write_rows(tmp_path / "b.jsonl", _unique_rows(200, seed=2))
    cfg = TrainConfig(data=f"jsonl:{a}=0.25,jsonl:{b}=0.75", data_texts=80).validate()
    samples = load_samples(cfg.data, tiny_tokenizer(), None, tmp_path, cfg)
    by_source = Counter(s.source for s in samples)
    assert by_source == {f"jsonl:{a}": 20, f"jsonl:{b}": 60}
    stream = BatchStream(samples, batch_size=8, seq_len=32, pad_id=63, seed=0)
    drawn = Counter(samples[int(i)].source for _ in range(200) for i in next(stream).indices)
    assert abs(drawn[f"jsonl:{b}"] / sum(drawn.values()) - 0.75) < 0.02


def test_packaged_sources_are_deduplicated_and_never_eval_split():
    index = eval_index()
    pool = Pool(index)
    rows = {
        kind: pool.take(Source(kind, "", 1.0), packaged_rows(kind, 0), n, lambda row, number: [row])
        for kind, n in (("gsm8k", 300), ("humaneval", 60), ("sharegpt", 800))
    }
    taken = [row for chosen in rows.values() for row in chosen]
    assert {kind: len(chosen) for kind, chosen in rows.items()} == {
        "gsm8k": 300,
        "humaneval": 60,
        "sharegpt": 800,
    }
    assert len({normalized(r["prompt"] + "\n" + r["response"]) for r in taken}) == len(taken)
    assert not any(in_split(row["id"], "eval") for row in taken)
    assert all(index.hit(row["prompt"], row["response"]) is None for row in taken)
    # independently of the index: no prompt the bench can draw appears inside a training text
    text = "\n".join(normalized(r["prompt"] + " " + r["response"]) for r in taken)
    bench = prompt_set("mixed", 400, 0, split="eval") + prompt_set("structured", None, 0, split="eval")
    leaked = [e.id for e in bench if len(normalized(e.prompt).split()) >= 6 and normalized(e.prompt) in text]
    assert not leaked


def test_a_packaged_source_asked_for_more_than_it_has_is_a_clear_error():
    with pytest.raises(UserError, match="humaneval gives only"):
        Pool(eval_index()).take(
            Source("humaneval", "", 1.0), packaged_rows("humaneval", 0), 500, lambda row, number: [row]
        )


def _eval_question() -> str:
    return next(e.prompt for e in gsm8k() if in_split(e.id, "eval"))


@pytest.mark.parametrize(
    "disguise",
    [
        lambda q: q,
        lambda q: (
            "Please help with this one.\n" + q.upper().replace(" ", "  ").replace(".", " .") + "\nThanks!"
        ),
    ],
)
def test_a_file_holding_eval_text_is_refused_with_exit_2(base_dir, tmp_path, capsys, disguise):
    rows = _unique_rows(30, seed=3)
    rows[17] = {"prompt": disguise(_eval_question()), "response": "t1 t2 t3"}
    data = write_rows(tmp_path / "rows.jsonl", rows)
    code = main(
        [
            "train",
            f"model={base_dir}",
            f"data=jsonl:{data}",
            f"out={tmp_path / 'run'}",
            "steps=1",
            "k_max=4",
            "seq_len=32",
            "region_width=8",
            "dtype=fp32",
            "--quiet",
        ]
    )
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "Loading weights" not in line]
    assert code == 2 and len(err) == 1 and err[0].startswith("mtplm train: error: data jsonl:")
    assert "row 18 overlaps the eval example gsm8k/" in err[0] and "nothing is trained on eval data" in err[0]
    assert not (tmp_path / "run" / "checkpoint").exists() and not (tmp_path / "run" / "train_state").exists()


def test_the_index_catches_near_duplicates_but_not_shared_phrases():
    index = EvalIndex(
        [
            (
                "eval/1",
                "Janet has three apples and buys five more at the market on a sunny day. "
                "How many apples does she have now?",
            ),
            ("eval/2", "Explain quantum computing"),
        ]
    )
    assert index.hit("JANET has three apples, and buys five more at the market on a sunny day!") == "eval/1"
    assert index.hit("explain   Quantum computing.") == "eval/2"
    assert index.hit("Explain quantum computing to a child in three sentences, with an example") is None
    assert index.hit("How many apples does she have now?") is None
    assert (
        index.hit(
            "prompt",
            "a reply that quotes: janet has three apples and buys five more at the market on a sunny day",
        )
        == "eval/1"
    )


class _StubModel:
    """Answers every prompt with the same two tokens (self_generate only calls generate)."""

    def generate(self, ids, attention_mask, max_new_tokens, do_sample, pad_token_id):
        import torch

        return torch.cat([ids, torch.tensor([[5, 6]] * len(ids))], 1)


def test_self_generation_never_answers_an_eval_prompt_and_caches_by_id(tmp_path):
    cfg = TrainConfig(self_gen_batch=4)
    train_prompts = prompt_set("structured", 6, 0, split="train")
    flagged = EvalIndex([("eval/x", train_prompts[2].prompt)])
    cache = tmp_path / "selfgen.jsonl"
    rows = self_generate(_StubModel(), tiny_tokenizer(), "structured", 6, cfg, cache, flagged)
    assert [r["id"] for r in rows] == [e.id for i, e in enumerate(train_prompts) if i != 2]
    assert len(cache.read_text().splitlines()) == 5
    again = self_generate(
        None, tiny_tokenizer(), "structured", 4, cfg, cache, flagged
    )  # all cached: no model
    assert [r["id"] for r in again] == [
        e.id for e in prompt_set("structured", 4, 0, split="train") if e.id != train_prompts[2].id
    ]
    assert all(json.loads(line)["id"] for line in Path(cache).read_text().splitlines())


def test_a_self_generation_cache_torn_by_a_kill_drops_only_its_last_line(tmp_path):
    cfg = TrainConfig(self_gen_batch=4)
    cache = tmp_path / "selfgen.jsonl"
    whole = self_generate(_StubModel(), tiny_tokenizer(), "structured", 4, cfg, cache)
    lines = cache.read_text().splitlines()
    cache.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])  # killed while writing the 4th answer
    assert self_generate(_StubModel(), tiny_tokenizer(), "structured", 4, cfg, cache) == whole
    assert [
        json.loads(line) for line in cache.read_text().splitlines()
    ] == whole  # re-answered on its own line
    cache.write_text("not json\n" + cache.read_text())  # damage anywhere else is not a kill: refused
    with pytest.raises(UserError, match="cannot read training data"):
        self_generate(_StubModel(), tiny_tokenizer(), "structured", 4, cfg, cache)
