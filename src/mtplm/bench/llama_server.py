"""`mtplm bench --llama-server`: llama.cpp's own server as outside baseline rows, beside mtplm's modes.

The binary and its matching HF -> GGUF converter are installed by `scripts/install_llama_server.sh` into
`$MTPLM_HOME/llama.cpp`. Each variant (`q4`, `f16`, `f16+ngram-simple`, ...) is one `llama-server` process on
loopback, started once, with one slot (`--parallel 1`) and torch's thread count. Every held-out prompt goes to
its `/completion` endpoint as token ids (the same ids mtplm decodes), greedy, without prompt caching, and the
generated ids come back with `return_tokens`. The server's own `timings` give its decode speed and, for drafters,
`draft_n` / `draft_n_accepted`: each verification pass yields its accepted drafts plus one token of its own, so
passes = predicted_n - draft_n_accepted (the prompt pass that yields the first token counts as one).
Startup is bounded; a server that dies or stays silent raises `LlamaServerError` carrying its log tail.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, NoReturn

import psutil

from mtplm.assets.models import SOURCE_FILE, base_model_dir, cache_dir, say
from mtplm.errors import UserError
from mtplm.llamacpp import convert, converter, server_binary

DEFAULT_VARIANTS = "q4,f16,f16+ngram-simple,f16+ngram-mod"
WEIGHTS = ("q4", "f16")  # q4: the GGUF the model was converted from; f16: converted from its HF directory
NGRAM_DRAFTERS = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")  # --spec-type values
EAGLE3 = "eagle3"  # the benched checkpoint's own drafter, converted to a GGUF: --spec-type draft-eagle3
DRAFTERS = (*NGRAM_DRAFTERS, EAGLE3)
STARTUP_TIMEOUT_S = 120.0  # model load + warm-up; a 0.5B f16 GGUF loads in seconds on the CPUs measured
REQUEST_TIMEOUT_S = 600.0  # one prompt: 128 tokens at even 1 token/s fit


class LlamaServerError(UserError):
    """llama-server did not start or stopped answering; the message ends with the tail of its log."""


class BaselineOutput(NamedTuple):
    """What an outside baseline returns for one prompt (HF runners fill the first two fields only)."""

    tokens: list[int]
    seconds: float  # wall clock of the whole request, prompt processing included (as for mtplm's rows)
    passes: int | None = None  # target forward passes, when the engine says
    ttft_s: float | None = None
    peak_rss_mb: float | None = None  # of the engine's own process, when it runs apart from this one


def add_argument(parser) -> None:
    parser.add_argument("--llama-server", nargs="?", const=DEFAULT_VARIANTS, default=None, metavar="VARIANTS",
                        help="also run llama.cpp's llama-server (scripts/install_llama_server.sh) on loopback: a "
                             "comma list of q4|f16 with an optional +<drafter>: an n-gram drafter "
                             f"({', '.join(NGRAM_DRAFTERS)}) or {EAGLE3}[@P] (the --model checkpoint's eagle3 "
                             "drafter, converted for --spec-type draft-eagle3; @P: stop a draft at a token the "
                             f"drafter gives less than P, --spec-draft-p-min); bare: {DEFAULT_VARIANTS}")


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
    """`q4,f16,f16+ngram-mod` -> variants; each drafter's plain variant is added, since it is compared with it."""
    variants: list[Variant] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        weights, plus, drafter = item.partition("+")
        drafter, at, p_min = drafter.partition("@")
        if weights not in WEIGHTS or (plus and drafter not in DRAFTERS) or (at and not _probability(p_min, drafter)):
            raise UserError(f"--llama-server: unknown variant {item!r}; use q4 or f16, optionally with "
                            f"+{'|+'.join(DRAFTERS)} (eagle3@P with 0 <= P < 1; e.g. {DEFAULT_VARIANTS})")
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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LlamaServer:
    """One llama-server process on loopback, one slot; `complete` decodes token ids greedily."""

    gguf: Path
    threads: int
    context: int
    drafter: str | None = None  # a --spec-type, or EAGLE3 with draft_model
    binary: Path | None = None
    draft_model: Path | None = None  # the draft-eagle3 GGUF
    draft_max: int = 3  # tokens an eagle3 drafter proposes per pass (llama.cpp's default: 3)
    draft_p_min: float | None = None  # --spec-draft-p-min (None: llama.cpp's default)
    draft_mb: float | None = None  # its size, read at start (the scratch copy is gone when the report is made)
    startup_timeout_s: float = STARTUP_TIMEOUT_S
    parallel: int = 1  # request slots decoded together (continuous batching); the context is split among them
    timings: list[dict] = field(default_factory=list)  # the server's own timings, one per request
    startup_s: float | None = None
    url: str = field(init=False, default="")
    log: Path | None = field(init=False, default=None)
    process: subprocess.Popen | None = field(init=False, default=None)

    def flags(self) -> list[str]:
        """Everything but the binary, the model and the address; llama.cpp's defaults for the rest."""
        flags = ["--threads", str(self.threads), "--ctx-size", str(self.context), "--parallel", str(self.parallel)]
        if self.drafter == EAGLE3:
            return flags + ["--spec-type", "draft-eagle3", "--model-draft", str(self.draft_model),
                            "--spec-draft-n-max", str(self.draft_max)] + (
                ["--spec-draft-p-min", str(self.draft_p_min)] if self.draft_p_min is not None else [])
        return flags + (["--spec-type", self.drafter] if self.drafter else [])

    def command(self, port: int) -> list[str]:
        binary = self.binary or server_binary()
        return [str(binary), "--model", str(self.gguf), "--host", "127.0.0.1", "--port", str(port), *self.flags()]

    def start(self) -> LlamaServer:
        """Start the process and wait (bounded) until /health answers; on failure stop it and raise."""
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        descriptor, log_name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        self.log = Path(log_name)
        started = time.perf_counter()
        with os.fdopen(descriptor, "wb") as log:
            process = subprocess.Popen(self.command(port), stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        self.process = process
        atexit.register(self.close)
        while not self._healthy():
            if process.poll() is not None:  # e.g. a GGUF it cannot read
                self._fail(f"exited with status {process.returncode} while starting")
            if time.perf_counter() - started > self.startup_timeout_s:
                self._fail(f"was not ready within {self.startup_timeout_s:.0f} s")
            time.sleep(0.1)
        self.startup_s = time.perf_counter() - started
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                return reply.status == 200
        except (OSError, urllib.error.URLError):  # refused while binding, 503 while loading
            return False

    def _fail(self, what: str) -> NoReturn:
        self.close(keep_log=True)
        raise LlamaServerError(f"llama-server ({self.gguf.name}) {what}; last lines of {self.log}:\n"
                               f"{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log else "(no log)"
        except OSError:
            return "(no log)"

    def complete(self, ids: list[int], max_new_tokens: int, stops: list[int] | None = None) -> BaselineOutput:
        """Greedy decoding of `ids` (prompt as token ids, no prompt cache); output cut after the first stop id."""
        body = {"prompt": list(ids), "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1,
                "samplers": ["top_k"], "cache_prompt": False, "return_tokens": True, "stream": False,
                "response_fields": ["tokens", "timings"]}
        request = urllib.request.Request(f"{self.url}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
                answer = json.loads(reply.read())
        except (OSError, urllib.error.URLError, ValueError) as exc:
            self._fail(f"did not answer a completion ({exc})")
        seconds = time.perf_counter() - start
        tokens = cut_at_stop([int(t) for t in answer["tokens"]], stops or [])
        timings = answer.get("timings", {})
        self.timings.append(timings)
        passes = timings.get("predicted_n", len(tokens)) - timings.get("draft_n_accepted", 0)
        return BaselineOutput(tokens, seconds, max(1, passes), timings.get("prompt_ms", 0.0) / 1000,
                              self.rss_mb())

    def rss_mb(self) -> float | None:
        """The server process's resident memory now (its weights are mapped in after the first request)."""
        try:
            return psutil.Process(self.process.pid).memory_info().rss / 2**20 if self.process else None
        except psutil.Error:
            return None

    def close(self, keep_log: bool = False) -> None:
        """Stop the process (terminate, then kill after 10 s); its log is kept only when something failed."""
        atexit.unregister(self.close)
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.log is not None and not keep_log:
            self.log.unlink(missing_ok=True)

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def cut_at_stop(tokens: list[int], stops: list[int]) -> list[int]:
    """Tokens up to and including the first stop id (llama.cpp stops at its own end-of-generation set)."""
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1]
    return tokens


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


def f16_gguf(base: Path, progress: bool = True) -> Path:
    """An f16 GGUF of an HF model directory, converted once by the installed llama.cpp converter and cached as
    `$MTPLM_HOME/gguf/<directory name>-f16.gguf` (written atomically)."""
    target = cache_dir() / "gguf" / f"{base.name}-f16.gguf"
    if target.is_file():
        return target
    converter()  # not installed: say so before announcing a conversion
    say(f"converting {base} to an f16 GGUF (llama.cpp's convert_hf_to_gguf.py) ...", progress)
    return convert(base, target, "--outtype", "f16")


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
        return {v.name: (runner(s), v.plain.name if v.drafter else "ntp") for v, s in self.servers.items()}

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
        "gguf": str(server.gguf), "gguf_mb": round(server.gguf.stat().st_size / 2**20, 1),
        "flags": " ".join(server.flags()), "startup_s": round(server.startup_s or 0, 1),
        "draft_gguf_mb": server.draft_mb,
        "server_tokens_per_s": 1000 * predicted / decode_ms if decode_ms else None,
        "draft_n": drafted, "draft_n_accepted": accepted,
        "acceptance": accepted / drafted if drafted else None,
        "tokens_per_pass": predicted / max(1, predicted - accepted) if predicted else None,
    }


def start_servers(args, model, prompts: list[list[int]], stops: list[int]) -> ServerBaselines | None:
    """One warmed-up server per variant of `args.llama_server` (None when not asked for), with torch's thread
    count; a variant whose GGUF cannot be found is skipped with a message."""
    import torch

    if not args.llama_server:
        return None
    variants, threads, max_new_tokens = parse_variants(args.llama_server), torch.get_num_threads(), args.max_new_tokens
    binary, base = server_binary(), base_dir(model)
    ggufs = {"q4": source_gguf(base) if base and any(v.weights == "q4" for v in variants) else None,
             "f16": f16_gguf(base) if base and any(v.weights == "f16" for v in variants) else None}
    # room for the longest prompt, the new tokens, and a drafter's longest draft (ngram-mod: 64)
    context = 256 * -(-(max(map(len, prompts)) + max_new_tokens + 80) // 256)
    started = ServerBaselines({}, max_new_tokens, stops)
    try:
        drafter = eagle3_gguf(args.model, base, started) if any(v.drafter == EAGLE3 for v in variants) else None
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
                server.draft_mb = round(drafter.stat().st_size / 2**20, 1)
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
    lines = ["### llama-server (its own timings)", "",
             "| variant | GGUF MB | server decode tokens/s | drafted | accepted | acceptance | tokens/pass | flags |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        rate = f"{s['server_tokens_per_s']:.1f}" if s["server_tokens_per_s"] else "–"
        acceptance = f"{100 * s['acceptance']:.0f} %" if s["acceptance"] is not None else "–"
        per_pass = f"{s['tokens_per_pass']:.2f}" if s["tokens_per_pass"] else "–"
        lines.append(f"| {name} | {s['gguf_mb']} | {rate} | {s['draft_n']} | {s['draft_n_accepted']} | "
                     f"{acceptance} | {per_pass} | `{s['flags']}` |")
    return lines + ["", "Server decode tokens/s excludes prompt processing and HTTP; the table above times the "
                        "whole request. tokens/pass = predicted / (predicted - accepted drafts).", ""]
