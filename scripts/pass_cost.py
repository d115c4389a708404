"""The cost curve t(batch, rows per sequence) of one decode pass on this machine, per backend, and
the roofline ratio of a 1-row pass.

Each pass feeds `rows` rows per sequence behind `context` cached positions through a backend
(decode/passes/backends.py, the seam the loop and the engine use), then the LM head over every fed
row. Row kinds:
`plain` tokens, or `mask` = 1 token + <mtp> slots (ConfAdapt's and verified's passes: the gated adapters
run). Backends alternate pass by pass so load drifts hit all alike; the best of `repeats` is printed in
ms with the ratio to the same backend's 1-row pass.

Roofline: a copy benchmark measures this machine's memory bandwidth (bytes read + written per second); a
1-row pass must read every weight once, so its floor is weight bytes / bandwidth, and the ratio is the
measured 1-row pass over that floor.

    python scripts/pass_cost.py --backends eager,compiled --batches 1,8 --rows 1,2,4,8,16
    python scripts/pass_cost.py --backends compiled --batches 1 --kinds mask --json runs/compiled-cost.json
    python scripts/pass_cost.py --backends compiled --batches 1 --rows 1,8 --head argmax   # greedy's head
    # (gpu_check.sh):
    python scripts/pass_cost.py --random-like scripts/gpu/smollm2-135m-config.json --device cuda

`--random-like CONFIG` times a model of that shape with random weights, a `<mtp>` row and rank-32 gated
adapters (a pass's cost depends on shapes only), so a machine without the installed model can be measured.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch

from mtplm.decode.passes.backends import make_backend
from mtplm.decode.passes.passcost import PassCost
from mtplm.decode.protocol import Feed
from mtplm.model import MTPModel, load_model, parse_dtype


def synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # GPU passes are timed when they end, not when they are queued


def bandwidth(device: str, megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second of a large copy (read + write counted), best of `repeats`."""
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats + 1):
        synchronize()
        began = time.perf_counter()
        target.copy_(source)
        synchronize()
        best = min(best, time.perf_counter() - began)
    return 2 * source.numel() / best


def random_model(config_file: Path, dtype: str) -> MTPModel:
    """A model of the shape `config_file` describes, random weights, with `<mtp>` and rank-32 gated
    adapters."""
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_file), dtype=parse_dtype(dtype))
    words = {"<unk>": 0, "<eos>": 1}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="<unk>")), eos_token="<eos>"
    )
    model = MTPModel(hf.eval(), tokenizer, None)
    model.add_mask_token(k_max=8, base_identity={"random_like": str(config_file)})
    model.attach_gated_lora(32, 64.0)
    model.adapters_to(parse_dtype(dtype))
    return model


def best_of(runs: dict, repeats: int) -> dict[str, float]:
    best = {name: float("inf") for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            synchronize()
            began = time.perf_counter()
            run()
            synchronize()
            best[name] = min(best[name], time.perf_counter() - began)
    return best


def feeds_for(model, kind: str, rows: int, batch: int) -> list[Feed]:
    tokens = [5] + [model.mask_id if kind == "mask" else 5] * (rows - 1)
    pending, slots = (1, rows - 1) if kind == "mask" else (rows, 0)
    return [Feed(tokens, pending, 0, slots, False, None)] * batch


def one_pass(backend, feeds: list[Feed], lengths: list[int], head: str = "full"):
    """A pass and its LM head over every fed row: the logits (`full`), or the greedy tokens alone from the
    backend's int8 copy of the head where it has one (`argmax`: what greedy decoding reads, mask rows
    included)."""
    chooser = getattr(backend, "greedy_head", None) if head == "argmax" else None
    apply = chooser if chooser is not None else backend.head

    def run() -> None:
        hidden = backend.run(0, feeds, lengths)
        apply(hidden.reshape(-1, hidden.shape[-1]))

    return run


def measure(model, args, batch: int) -> dict[tuple[str, str], list[float]]:
    """(backend, kind) -> best seconds per row count, at this batch size."""
    backends = {name: make_backend(name, model, batch) for name in args.backends.split(",")}
    prompt = [Feed(list(range(100, 100 + args.context)), args.context, 0, 0, False, None)] * batch
    lengths, rows_list = [args.context] * batch, [int(r) for r in args.rows.split(",")]
    table: dict[tuple[str, str], list[float]] = {}
    with torch.inference_mode():
        for backend in backends.values():
            backend.run(0, prompt, [0] * batch)
        for kind in args.kinds.split(","):
            for rows in rows_list:
                feeds = feeds_for(model, kind, rows, batch)
                runs = {name: one_pass(b, feeds, lengths, args.head) for name, b in backends.items()}
                for run in runs.values():
                    run()  # the compiled backend compiles a new bucket here
                for name, seconds in best_of(runs, args.repeats).items():
                    table.setdefault((name, kind), []).append(seconds)
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-mtp")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--backends", default="eager,compiled")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--kinds", default="plain,mask")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        help="also write the batch-1 mask-row curve of the first backend here (mtplm train pass_cost=FILE)",
    )
    p.add_argument(
        "--random-like",
        type=Path,
        default=None,
        metavar="CONFIG",
        help="time random weights of this config.json's shape instead of --model",
    )
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument(
        "--head",
        choices=("full", "argmax"),
        default="full",
        help="the LM head as logits (default) or greedy tokens from its int8 copy (greedy decoding's)",
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = (
        random_model(args.random_like, args.dtype) if args.random_like else load_model(args.model, args.dtype)
    )
    if args.device != "cpu":  # (a GGUF-blocks model holds its linears on meta: it runs on the CPU only)
        model.hf.to(args.device)
    torch.set_default_device(args.device)  # the backends' inputs and caches follow the weights
    rows_list = [int(r) for r in args.rows.split(",")]
    print(
        f"{args.random_like or args.model} {args.dtype} on {args.device}, context {args.context}, "
        f"{torch.get_num_threads()} threads, best of "
        f"{args.repeats}; ms per pass incl. the LM head ({args.head}; ratio to the same backend's 1-row pass)"
    )
    one_row: dict[str, float] = {}
    first: dict[str, tuple[float, ...]] = {}  # batch 1, first backend: kind -> the curve's times
    for batch in (int(b) for b in args.batches.split(",")):
        for (name, kind), times in measure(model, args, batch).items():
            print(
                f"batch {batch} {name:8s} {kind:5s}: "
                + "  ".join(
                    f"{r:2d} rows {1e3 * t:6.1f} ({t / times[0]:.2f}x)"
                    for r, t in zip(rows_list, times, strict=True)
                )
            )
            if batch == 1 and kind == "plain":
                one_row[name] = times[0]
            if batch == 1 and name == args.backends.split(",")[0]:
                first[kind] = tuple(itertools.accumulate(times, max))
    if args.json and "mask" in first:
        curve = PassCost(
            tuple(rows_list), first["mask"], args.backends.split(",")[0], args.context, first.get("plain")
        )
        print(f"curve written to {curve.save(args.json)} (what pass_cost=FILE reads): {curve.describe()}")
    rate = bandwidth(args.device)
    print(
        f"roofline: copy bandwidth {rate / 1e9:.1f} GB/s; "
        + ", ".join(
            roofline(name, t, read_bytes(model, name, args.head), rate) for name, t in one_row.items()
        )
    )


def roofline(name: str, seconds: float, weight_bytes: int, rate: float) -> str:
    """One backend's 1-row pass beside the time its weight reads take at copy bandwidth `rate` (bytes/s)."""
    return (
        f"{name} 1-row pass {1e3 * seconds:.1f} ms reads {weight_bytes / 1e6:.0f} MB of weights: floor "
        f"{1e3 * weight_bytes / rate:.1f} ms, {seconds * rate / weight_bytes:.2f}x the floor"
    )


def read_bytes(model, backend: str, head: str = "full") -> int:
    """Weight bytes a 1-row plain pass reads: the model's (the LM head once; not the adapters, which plain
    rows skip), with int8 projections at one byte a weight under the int8 backend and int4 ones at 5/8 of a
    byte (half a byte, and a 2-byte scale and zero per 32 weights); with head `argmax` the head at one byte
    a weight (its int8 copy)."""
    lm_head = model.hf.get_output_embeddings().weight
    total = 0.0 if head == "full" else lm_head.numel() * (1.0 - lm_head.element_size())
    packed = [(name, b) for name, b in model.hf.named_buffers() if name.endswith(".packed")]  # shared weights
    for name, p in [*model.hf.named_parameters(), *packed]:
        if "lora_" in name:
            continue
        projection = p.dim() >= 2 and ".layers." in name
        size = (
            {"int8": 1, "int4": 5 / 8}.get(backend[-4:], p.element_size()) if projection else p.element_size()
        )
        total += p.numel() * size
    return int(total)


if __name__ == "__main__":
    main()
