"""EleutherAI's lm-evaluation-harness (pinned, `lm-eval[api]`) against a live server: a loglikelihood
(multiple choice) task and a generate_until task through `local-completions`, the generation task again
through `local-chat-completions` with the chat template; every score and every per-choice loglikelihood
equal to what lm-eval's own Hugging Face backend gives for the same model."""

from __future__ import annotations

import json
import random

import pytest
from serving import LiveServer, write_manifest
from synthetic import PERMUTATION, chain_rows

pytest.importorskip("lm_eval", reason="lm-eval[api] is in the test extra")
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

# five strings: lm-eval appends the EOS string, so the server gets six (it used to refuse more than four)
UNTIL = ["\n", "zz1", "zz2", "zz3", "zz4"]
TASKS = {
    "chain_mc": {
        "output_type": "multiple_choice",
        "doc_to_text": "{{prompt}}",
        "doc_to_choice": "choices",
        "doc_to_target": "answer",
        "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
    },
    "chain_gen": {
        "output_type": "generate_until",
        "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{target}}",
        "generation_kwargs": {"until": UNTIL, "max_gen_toks": 4, "do_sample": False},
        "metric_list": [{"metric": "exact_match"}],
    },
}


def write_tasks(directory, docs: int = 12) -> None:
    """Two tiny tasks on the synthetic chain language (tests/synthetic.py), data beside their YAML."""
    rng = random.Random(5)
    rows = chain_rows(docs, seed=77)
    mc, gen = [], []
    for row in rows:
        words = row["response"].split()
        right = words[0]
        wrong = [f"t{(PERMUTATION[int(right[1:])] + d) % 60}" for d in (3, 17, 29)]
        choices = [right, *wrong]
        rng.shuffle(choices)
        mc.append({"prompt": row["prompt"], "choices": choices, "answer": choices.index(right)})
        gen.append({"prompt": row["prompt"], "target": " ".join(words[:4])})
    for name, data in (("chain_mc", mc), ("chain_gen", gen)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in data))
        task = {
            "task": name,
            "dataset_path": "json",
            "test_split": "test",
            "dataset_kwargs": {"data_files": {"test": str(directory / f"{name}.jsonl")}},
            **TASKS[name],
        }
        (directory / f"{name}.yaml").write_text(json.dumps(task))  # JSON is YAML


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lm_eval_tasks")
    write_tasks(directory)
    return TaskManager(include_path=str(directory))


@pytest.fixture(scope="module")
def server(base_dir, tmp_path_factory):
    repo = write_manifest(tmp_path_factory.mktemp("repo"), {"tiny": (base_dir, None)})
    with LiveServer(repo, api_key=None) as live:
        yield live


def _evaluate(model: str, model_args: str, names: list[str], tasks, chat: bool = False) -> dict:
    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=names,
        task_manager=tasks,
        batch_size=4,
        log_samples=True,
        apply_chat_template=chat,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


def _loglikelihoods(result: dict, name: str) -> list[float]:
    return [resp[0][0] for sample in result["samples"][name] for resp in sample["resps"]]


@pytest.fixture(scope="module")
def reference(base_dir, tasks):
    """lm-eval's HF backend on the same weights (fp32, CPU)."""
    return _evaluate(
        "hf", f"pretrained={base_dir},dtype=float32,device=cpu", ["chain_mc", "chain_gen"], tasks
    )


def test_local_completions_loglikelihood_and_generation(server, base_dir, tasks, reference):
    args = (
        f"model=tiny,base_url={server.url}/v1/completions,tokenizer={base_dir},tokenizer_backend=huggingface,"
        "num_concurrent=1,max_retries=1"
    )
    served = _evaluate("local-completions", args, ["chain_mc", "chain_gen"], tasks)
    for name, metric in (
        ("chain_mc", "acc,none"),
        ("chain_mc", "acc_norm,none"),
        ("chain_gen", "exact_match,none"),
    ):
        print(
            f"\nlm-eval {name} {metric}: served {served['results'][name][metric]:.4f}, "
            f"hf {reference['results'][name][metric]:.4f}"
        )
        assert served["results"][name][metric] == pytest.approx(reference["results"][name][metric], abs=1e-4)
    ours, theirs = _loglikelihoods(served, "chain_mc"), _loglikelihoods(reference, "chain_mc")
    assert len(ours) == len(theirs) == 48
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-4
    assert served["results"]["chain_mc"]["acc,none"] > 0.5  # the model has learned the language


def test_local_chat_completions_with_the_chat_template(server, base_dir, tasks):
    args = f"model=tiny,base_url={server.url}/v1/chat/completions,num_concurrent=1,max_retries=1"
    served = _evaluate("local-chat-completions", args, ["chain_gen"], tasks, chat=True)
    local = _evaluate(
        "hf", f"pretrained={base_dir},dtype=float32,device=cpu", ["chain_gen"], tasks, chat=True
    )
    print(
        "\nlm-eval chat chain_gen exact_match: "
        f"served {served['results']['chain_gen']['exact_match,none']:.4f}, "
        f"hf {local['results']['chain_gen']['exact_match,none']:.4f}"
    )
    assert (
        served["results"]["chain_gen"]["exact_match,none"]
        == local["results"]["chain_gen"]["exact_match,none"]
    )
    assert [s["filtered_resps"] for s in served["samples"]["chain_gen"]] == [
        s["filtered_resps"] for s in local["samples"]["chain_gen"]
    ]
