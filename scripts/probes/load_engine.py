"""The load test's workload on the batch engine alone, in this process (no HTTP, no tokenizer round trip
beyond the prompt): what `mtplm serve` could deliver at best. scripts/probes/load_test.py --engine uses it.

Each of N client threads submits its prompts one after another as engine jobs (greedy, the chat template,
the same max_tokens and mode as the HTTP clients) and waits for each to finish; completion tokens are
counted as the server counts them (a final stop token not counted).
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from mtplm.config import parse_mode
from mtplm.decode.passes.backends import make_backend
from mtplm.decode.run.engine import Engine, Job
from mtplm.decode.run.warm import warm_up
from mtplm.model import load_model
from mtplm.serve import parse_k_by_batch
from mtplm.text import chat_prompt_ids


def run_engine(args, prompts: list[str], modes: list[str], summary) -> list[dict]:
    """Rows like the HTTP test's (`summary(mode, records, wall)`), one per mode, best of the rounds."""
    spec = args.model.partition("=")[2] or args.model
    cfgs = {
        mode: replace(parse_mode(mode), max_new_tokens=args.max_tokens, temperature=0.0) for mode in modes
    }
    ids: list[list[int]] = []

    def build():  # on the engine's thread, as the server loads its models
        model = load_model(spec, args.dtype)
        backend = make_backend(args.backend, model, args.max_batch)
        ids.extend(chat_prompt_ids(model.tokenizer, p) for p in prompts)
        warm_up(
            backend,
            model,
            list(cfgs.values()),
            (min(map(len, ids)), max(map(len, ids))),
            args.max_tokens,
            args.max_batch,
            what="the engine",
        )
        return model, backend

    k_by_batch = parse_k_by_batch(args.k_by_batch) if args.k_by_batch else parse_k_by_batch("2:1")
    engine = Engine.on_own_thread(build, max_batch=args.max_batch, k_by_batch=k_by_batch)
    try:
        for cfg in cfgs.values():  # warm-up, as the HTTP test's
            _round(engine, cfg, [ids[i % len(ids)] for i in range(args.clients)], args.clients, 1)
        records = {mode: [] for mode in modes}
        walls = {mode: 0.0 for mode in modes}
        for round_ in range(args.rounds):
            for mode in modes if round_ % 2 == 0 else modes[::-1]:
                began = time.perf_counter()
                records[mode] += _round(engine, cfgs[mode], ids, args.clients, args.requests)
                walls[mode] += time.perf_counter() - began
    finally:
        engine.close(0)
    return [summary(mode, records[mode], walls[mode]) for mode in modes]


def _round(engine: Engine, cfg, ids: list[list[int]], clients: int, per_client: int) -> list[dict]:
    out: list[dict] = []
    threads = [
        threading.Thread(target=_client, args=(engine, cfg, ids[c * per_client : (c + 1) * per_client], out))
        for c in range(clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def _client(engine: Engine, cfg, prompts: list[list[int]], out: list[dict]) -> None:
    for prompt in prompts:
        out.append(_one(engine, cfg, prompt))


def _one(engine: Engine, cfg, prompt: list[int]) -> dict:
    done, record = threading.Event(), {"error": None, "tokens": 0, "passes": 0, "ttft": 0.0}
    began = time.perf_counter()

    def emit(step, error) -> None:
        if error is not None:
            record["error"] = str(error)
            done.set()
            return
        if not record["ttft"] and step.tokens:
            record["ttft"] = time.perf_counter() - began
        record["tokens"] += len(step.tokens) - (1 if step.stopped else 0)
        record["passes"] += 1
        if step.last:
            done.set()

    engine.submit(Job(prompt, cfg, emit, label="load"))
    done.wait()
    record["latency"] = time.perf_counter() - began
    return record
