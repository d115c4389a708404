"""Prometheus metrics of one server (its own registry, so several servers can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mtplm.decode.run.engine import PassStats

LATENCY = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160)
PER_PASS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)


def endpoint_label(path: str) -> str:
    """The `endpoint` label of a request path in the metrics."""
    path = path.rstrip("/")
    return {
        "/v1/completions": "completions",
        "/v1/chat/completions": "chat",
        "/v1/responses": "responses",
    }.get(path, "other")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._define_requests(self.registry)
        self._define_tokens(self.registry)
        self._define_passes(self.registry)

    def _define_requests(self, r: CollectorRegistry) -> None:
        """What clients see: requests answered, their latency and time to first token."""
        self.requests = Counter(
            "mtplm_requests", "HTTP requests answered", ["endpoint", "model", "status"], registry=r
        )
        self.latency = Histogram(
            "mtplm_request_latency_seconds",
            "request latency, to the last byte",
            ["endpoint", "model"],
            buckets=LATENCY,
            registry=r,
        )
        self.ttft = Histogram(
            "mtplm_time_to_first_token_seconds",
            "time to the first generated token",
            ["model"],
            buckets=LATENCY,
            registry=r,
        )

    def _define_tokens(self, r: CollectorRegistry) -> None:
        """What each sequence got from its passes, by decoding mode: tokens, drafts and acceptance."""
        self.tokens = Counter("mtplm_generated_tokens", "tokens generated", ["model", "mode"], registry=r)
        self.sequence_passes = Counter(
            "mtplm_sequence_passes",
            "forward passes, counted once per sequence in them",
            ["model", "mode"],
            registry=r,
        )
        self.per_pass = Histogram(
            "mtplm_tokens_per_forward",
            "tokens a sequence emitted in one forward pass",
            ["model", "mode"],
            buckets=PER_PASS,
            registry=r,
        )
        self.drafted = Counter(
            "mtplm_drafted_tokens", "drafts verified (verified mode)", ["model", "mode"], registry=r
        )
        self.accepted = Counter(
            "mtplm_accepted_tokens",
            "drafts kept (verified mode); acceptance = accepted / drafted",
            ["model", "mode"],
            registry=r,
        )

    def _define_passes(self, r: CollectorRegistry) -> None:
        """What the engines did: forward passes, their time and batches, queues and loaded models."""
        self.passes = Counter("mtplm_forward_passes", "engine forward passes", ["model", "kind"], registry=r)
        self.pass_seconds = Histogram(
            "mtplm_forward_pass_seconds",
            "engine forward pass time",
            ["model", "kind"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=r,
        )
        self.batch = Histogram(
            "mtplm_batch_sequences",
            "sequences per batched pass",
            ["model"],
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32),
            registry=r,
        )
        self.padding = Counter(
            "mtplm_padding_rows", "fed rows that were padding (ragged batches)", ["model"], registry=r
        )
        self.rows = Counter(
            "mtplm_fed_rows", "rows fed to the model, padding included", ["model"], registry=r
        )
        self.waiting = Gauge("mtplm_queue_length", "sequences waiting for a slot", ["model"], registry=r)
        self.running = Gauge("mtplm_running_sequences", "sequences decoding", ["model"], registry=r)
        self.loaded = Gauge("mtplm_loaded_models", "models in memory", registry=r)

    def count(self, path: str, model: str, status: int) -> None:
        """One request in mtplm_requests_total; `model` is the request's model where this server has it."""
        self.requests.labels(endpoint_label(path), model, str(status)).inc()

    def on_pass(self, model: str, stats: PassStats) -> None:
        """Called on an engine thread after every pass."""
        self.passes.labels(model, stats.kind).inc()
        self.pass_seconds.labels(model, stats.kind).observe(stats.seconds)
        self.rows.labels(model).inc(stats.rows)
        self.padding.labels(model).inc(stats.padding)
        if stats.kind == "decode":
            self.batch.labels(model).observe(stats.sequences)
        for label, step in zip(stats.labels, stats.steps, strict=False):
            self.tokens.labels(model, label).inc(len(step.tokens))
            self.sequence_passes.labels(model, label).inc()
            self.per_pass.labels(model, label).observe(len(step.tokens))
            if step.drafted:
                self.drafted.labels(model, label).inc(step.drafted)
                self.accepted.labels(model, label).inc(step.accepted)

    def render(self, repository) -> bytes:
        self.loaded.set(len(repository.loaded))
        for model_id, loaded in list(repository.loaded.items()):
            waiting, running = loaded.engine.load
            self.waiting.labels(model_id).set(waiting)
            self.running.labels(model_id).set(running)
        return generate_latest(self.registry)
