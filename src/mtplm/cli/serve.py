"""`mtplm serve`: the options of the OpenAI-compatible HTTP server, and starting it."""

from __future__ import annotations

from pathlib import Path

from mtplm.cli.defaults import DEFAULT_CHECKPOINT
from mtplm.config import DEFAULT_LOAD_POLICY, DEFAULT_MODE, Limits
from mtplm.errors import UserError
from mtplm.options import add_backend_argument, add_decode_dtype_argument, add_draft_model_argument


def add_serve(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (completions, chat, streaming) with "
        "per-request decoding modes, ragged batching and Prometheus metrics",
    )
    # The groups in the order --help lists them.
    _add_model_sources(serve)
    _add_http_arguments(serve)
    _add_decoding_arguments(serve)
    _add_request_limits(serve)
    _add_process_arguments(serve)
    serve.set_defaults(run=_serve)


def _add_model_sources(serve) -> None:
    """What to serve: models named one by one, or a repository directory."""
    serve.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="[ID=]SPEC",
        help=f"a model to serve (repeatable): checkpoint, shipped name or base model; "
        f"default {DEFAULT_CHECKPOINT} when no --repository is given",
    )
    serve.add_argument(
        "--repository", type=Path, help="a directory of checkpoints with a models.toml manifest"
    )


def _add_http_arguments(serve) -> None:
    """Where to listen and who may call."""
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)"
    )
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    serve.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set MTPLM_API_KEY)"
    )


def _add_decoding_arguments(serve) -> None:
    """How each model loads and decodes: dtype, backend, batching, memory, default mode, load policy."""
    add_decode_dtype_argument(serve)
    add_backend_argument(serve)
    serve.add_argument(
        "--max-batch", type=int, default=8, help="sequences decoded together per model (default: 8)"
    )
    serve.add_argument(
        "--memory-budget-gb",
        type=float,
        default=0.0,
        help="load models lazily within this much memory, unloading idle ones (0: no limit)",
    )
    serve.add_argument(
        "--default-mode",
        default=None,
        help=f"decoding mode for requests that name none (default: {DEFAULT_MODE}, drafts copied "
        "from the text and verified: lossless, for any model, the fastest measured; see "
        "README); a request's `mode` field overrides it",
    )
    add_draft_model_argument(
        serve,
        "a smaller model of the served model's tokenizer that drafts for it in requests whose mode names "
        "the draft source `draft` (verified:draft, verified:quadratic+draft; also as --default-mode): "
        "loaded and compiled at start, one model served; the output stays the served model's own "
        "(docs/serving.md)",
    )
    serve.add_argument(
        "--k-by-batch",
        default=DEFAULT_LOAD_POLICY,
        metavar="SIZE:K,...|auto|off",
        help="load policy for ConfAdapt and verified: SIZE:K pairs cap them at K tokens per pass "
        "once SIZE or more sequences run, e.g. 1:8,4:4,8:1; 'auto' measures, per batch size, "
        "whether multi-token passes beat plain ones; 'off': no cap (default: %(default)s, "
        "multi-token passes only while one sequence runs: on the CPUs measured they lose "
        "to plain batched passes; see README)",
    )


def _add_request_limits(serve) -> None:
    """The caps on what one request may ask for."""
    serve.add_argument(
        "--max-tokens-limit",
        type=int,
        default=Limits.max_tokens,
        help="largest max_tokens accepted (default: %(default)s)",
    )
    serve.add_argument(
        "--default-max-tokens",
        type=int,
        default=Limits.default_max_tokens,
        help="max_tokens of chat requests that give none (default: %(default)s)",
    )
    serve.add_argument(
        "--context",
        type=int,
        default=Limits.context,
        help="prompt + max_tokens cap; the model's own context also applies (default: %(default)s)",
    )


def _add_process_arguments(serve) -> None:
    """The server process: shutdown and threads."""
    serve.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        help="seconds in-flight requests may finish after SIGTERM or Ctrl-C before they are failed "
        "(default: %(default)s)",
    )
    serve.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")


def _serve(args) -> None:
    import os

    import torch

    try:
        from mtplm.serve import Settings, build_repository, limits, serve
    except ImportError as exc:
        raise UserError(
            f"mtplm serve needs the serve extra ({exc.name} is missing): pip install 'mtplm[serve]'"
        ) from None

    if args.threads:
        torch.set_num_threads(args.threads)
    models = args.model or ([] if args.repository else [DEFAULT_CHECKPOINT])
    repository = build_repository(
        models,
        args.repository,
        args.dtype,
        args.max_batch,
        args.memory_budget_gb,
        args.default_mode,
        args.k_by_batch,
        args.backend,
        args.draft_model,
    )
    settings = Settings(
        api_key=args.api_key or os.environ.get("MTPLM_API_KEY") or None,
        limits=limits(args.max_tokens_limit, args.default_max_tokens, args.context),
    )
    serve(repository, args.host, args.port, settings, args.shutdown_grace)
