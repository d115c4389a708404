"""`mtplm bench --llama-server`: llama.cpp's own server as outside baseline rows, beside mtplm's modes.

The binary and its matching HF -> GGUF converter are installed by `scripts/install_llama_server.sh` into
`$MTPLM_HOME/llama.cpp`. Each variant (`q4`, `f16`, `f16+ngram-simple`, ...) is one `llama-server` process on
loopback, started once, with one slot (`--parallel 1`) and torch's thread count. Every held-out prompt goes to
its `/completion` endpoint as token ids (the same ids mtplm decodes), greedy, without prompt caching, and the
generated ids come back with `return_tokens`. The server's own `timings` give its decode speed and, for
drafters, `draft_n` / `draft_n_accepted`: each verification pass yields its accepted drafts plus one token of
its own, so passes = predicted_n - draft_n_accepted (the prompt pass that yields the first token counts as
one). Startup is bounded; a server that dies or stays silent raises `LlamaServerError` carrying its log tail.
The process runner itself is llamacpp/server.py (training's self-generation uses it too); this module is the
bench's.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mtplm.assets.models import SOURCE_FILE, base_model_dir, say
from mtplm.config import PLAIN_MODE
from mtplm.errors import UserError
from mtplm.llamacpp import converter, server_binary
from mtplm.llamacpp.server import EAGLE3, LlamaServer, f16_gguf

DEFAULT_VARIANTS = "q4,f16,f16+ngram-simple,f16+ngram-mod"
WEIGHTS = ("q4", "f16")  # q4: the GGUF the model was converted from; f16: converted from its HF directory
NGRAM_DRAFTERS = (
    "ngram-simple",
    "ngram-map-k",
    "ngram-map-k4v",
    "ngram-mod",
    "ngram-cache",
)  # --spec-type values
DRAFTERS = (*NGRAM_DRAFTERS, EAGLE3)


def add_argument(parser) -> None:
    parser.add_argument(
        "--llama-server",
        nargs="?",
        const=DEFAULT_VARIANTS,
        default=None,
        metavar="VARIANTS",
        help="also run llama.cpp's llama-server (scripts/install_llama_server.sh) on loopback: a "
        "comma list of q4|f16 with an optional +<drafter>: an n-gram drafter "
        f"({', '.join(NGRAM_DRAFTERS)}) or {EAGLE3}[@P] (the --model checkpoint's eagle3 "
        "drafter, converted for --spec-type draft-eagle3; @P: stop a draft at a token the "
        f"drafter gives less than P, --spec-draft-p-min); bare: {DEFAULT_VARIANTS}",
    )


def check(spec: str | None, model: str) -> None:
    """Fail early (before any model loads) on a bad --llama-server value, a missing binary, or +eagle3 for a
    checkpoint without an eagle3 drafter."""
    if spec is not None:
        variants = parse_variants(spec)
        server_binary()
        if any(v.drafter == EAGLE3 for v in variants):
            from mtplm.heads.export import eagle3_meta

            eagle3_meta(model)
            converter()


@dataclass(frozen=True)
class Variant:
    """One server configuration: which weights, and which drafter (None: plain decoding)."""

    weights: str
    drafter: str | None = None
    p_min: float | None = None  # eagle3: llama.cpp's --spec-draft-p-min (None: its default, 0: full drafts)

    @property
    def name(self) -> str:
        name = f"llama-server:{self.weights}"
        if self.drafter:
            name += f"+{self.drafter}"
        return name + (f"@{self.p_min:g}" if self.p_min is not None else "")

    @property
    def plain(self) -> Variant:
        return Variant(self.weights)


def parse_variants(spec: str) -> list[Variant]:
    """`q4,f16,f16+ngram-mod` -> variants; each drafter's plain variant is added, since it is compared
    with it."""
    variants: list[Variant] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        weights, plus, drafter = item.partition("+")
        drafter, at, p_min = drafter.partition("@")
        if (
            weights not in WEIGHTS
            or (plus and drafter not in DRAFTERS)
            or (at and not _probability(p_min, drafter))
        ):
            raise UserError(
                f"--llama-server: unknown variant {item!r}; use q4 or f16, optionally with "
                f"+{'|+'.join(DRAFTERS)} (eagle3@P with 0 <= P < 1; e.g. {DEFAULT_VARIANTS})"
            )
        for variant in (Variant(weights), Variant(weights, drafter or None, float(p_min) if at else None)):
            if variant not in variants:
                variants.append(variant)
    if not variants:
        raise UserError(f"--llama-server: no variants given (e.g. {DEFAULT_VARIANTS})")
    return variants


def _probability(text: str, drafter: str) -> bool:
    try:
        return drafter == EAGLE3 and 0.0 <= float(text) < 1.0
    except ValueError:
        return False


def base_dir(model) -> Path | None:
    """The HF directory a converted mtplm checkpoint was built on; for an unconverted model, its own
    directory (None when neither is a local HF directory)."""
    if model.meta and model.meta.base_model:
        return base_model_dir(model.meta.base_model)
    path = getattr(model.hf, "name_or_path", None)
    return Path(path) if path and (Path(path) / "config.json").is_file() else None


def source_gguf(base: Path) -> Path | None:
    """The GGUF a registry model was converted from (recorded in its HF directory), if it still exists."""
    try:
        path = Path(json.loads((base / SOURCE_FILE).read_text())["gguf"])
    except (OSError, ValueError, KeyError):
        return None
    return path if path.is_file() else None


@dataclass
class ServerBaselines:
    """The running servers of one bench: runners for run.py's outside baselines, a summary for its report."""

    servers: dict[Variant, LlamaServer]
    max_new_tokens: int
    stops: list[int]
    scratch: tempfile.TemporaryDirectory | None = None  # holds the converted eagle3 drafter while servers run

    def runs(self) -> dict:
        """name -> (run(ids) -> BaselineOutput, the name of the row it is compared with)."""

        def runner(server: LlamaServer):
            return lambda ids: server.complete(ids, self.max_new_tokens, self.stops)

        return {
            v.name: (runner(s), v.plain.name if v.drafter else PLAIN_MODE) for v, s in self.servers.items()
        }

    def summary(self) -> dict:
        return {variant.name: summarize_timings(server) for variant, server in self.servers.items()}

    def close(self) -> None:
        for server in self.servers.values():
            server.close()
        if self.scratch is not None:
            self.scratch.cleanup()

    def __enter__(self) -> ServerBaselines:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def summarize_timings(server: LlamaServer) -> dict:
    """Totals of the server's own timings over the measured requests (the warm-up request excluded)."""
    timed = server.timings[1:]
    predicted = sum(t.get("predicted_n", 0) for t in timed)
    accepted = sum(t.get("draft_n_accepted", 0) for t in timed)
    drafted = sum(t.get("draft_n", 0) for t in timed)
    decode_ms = sum(t.get("predicted_ms", 0.0) for t in timed)
    return {
        "gguf": server.gguf.name,  # the file, not where this machine keeps it
        "gguf_mb": round(server.gguf.stat().st_size / 2**20, 1),
        "flags": " ".join(server.flags()),
        "startup_s": round(server.startup_s or 0, 1),
        "draft_gguf_mb": server.draft_mb,
        "server_tokens_per_s": 1000 * predicted / decode_ms if decode_ms else None,
        "draft_n": drafted,
        "draft_n_accepted": accepted,
        "acceptance": accepted / drafted if drafted else None,
        "tokens_per_pass": predicted / max(1, predicted - accepted) if predicted else None,
    }


def start_servers(args, model, prompts: list[list[int]], stops: list[int]) -> ServerBaselines | None:
    """One warmed-up server per variant of `args.llama_server` (None when not asked for), with torch's thread
    count; a variant whose GGUF cannot be found is skipped with a message."""
    import torch

    if not args.llama_server:
        return None
    variants, threads, max_new_tokens = (
        parse_variants(args.llama_server),
        torch.get_num_threads(),
        args.max_new_tokens,
    )
    binary, base = server_binary(), base_dir(model)
    ggufs = {
        "q4": source_gguf(base) if base and any(v.weights == "q4" for v in variants) else None,
        "f16": f16_gguf(base) if base and any(v.weights == "f16" for v in variants) else None,
    }
    # room for the longest prompt, the new tokens, and a drafter's longest draft (ngram-mod: 64)
    context = 256 * -(-(max(map(len, prompts)) + max_new_tokens + 80) // 256)
    started = ServerBaselines({}, max_new_tokens, stops)
    try:
        drafter = (
            eagle3_gguf(args.model, base, started) if any(v.drafter == EAGLE3 for v in variants) else None
        )
        for variant in variants:
            gguf = ggufs[variant.weights]
            if gguf is None:
                print(f"{variant.name} skipped: no {variant.weights} GGUF found for this model's base")
                continue
            say(f"starting {variant.name} ({gguf.name}) ...")
            server = LlamaServer(gguf, threads, context, variant.drafter, binary)
            if variant.drafter == EAGLE3:
                server.draft_model, server.draft_max = drafter, model.heads.k - 1
                server.draft_p_min = variant.p_min
                server.draft_mb = round(drafter.stat().st_size / 2**20, 1) if drafter else None
            started.servers[variant] = server.start()
            server.complete(prompts[0], 8, stops)  # warm-up, excluded from the summary
    except BaseException:
        started.close()
        raise
    return started


def eagle3_gguf(checkpoint: str, base: Path | None, baselines: ServerBaselines) -> Path:
    """The checkpoint's eagle3 drafter as a draft-eagle3 GGUF, in a scratch folder the baselines remove."""
    from mtplm.heads.export import export_gguf_eagle3

    if base is None:
        raise UserError(f"--llama-server +{EAGLE3}: the HF directory {checkpoint} was trained on is gone")
    baselines.scratch = tempfile.TemporaryDirectory(prefix="mtplm-eagle3-gguf-")
    say(f"converting the eagle3 drafter of {checkpoint} to a draft-eagle3 GGUF ...")
    return export_gguf_eagle3(checkpoint, Path(baselines.scratch.name) / "drafter-eagle3.gguf", base)


def markdown(summary: dict) -> list[str]:
    """The report's llama-server section: the servers' own decode speed and the drafters' acceptance."""
    if not summary:
        return []
    lines = [
        "### llama-server (its own timings)",
        "",
        "| variant | GGUF MB | server decode tokens/s | drafted | accepted | acceptance | tokens/pass "
        "| flags |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        rate = f"{s['server_tokens_per_s']:.1f}" if s["server_tokens_per_s"] else "–"
        acceptance = f"{100 * s['acceptance']:.0f} %" if s["acceptance"] is not None else "–"
        per_pass = f"{s['tokens_per_pass']:.2f}" if s["tokens_per_pass"] else "–"
        lines.append(
            f"| {name} | {s['gguf_mb']} | {rate} | {s['draft_n']} | {s['draft_n_accepted']} | "
            f"{acceptance} | {per_pass} | `{s['flags']}` |"
        )
    return lines + [
        "",
        "Server decode tokens/s excludes prompt processing and HTTP; the table above times the "
        "whole request. tokens/pass = predicted / (predicted - accepted drafts).",
        "",
    ]
