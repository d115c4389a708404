"""One request's sequences on an engine, as an async stream of text pieces.

The engine thread hands each step (a block of 1..k tokens) to the event loop; each choice turns its
blocks into text that never splits a UTF-8 character (text.StreamDecoder) and never shows the start of
a stop string that might still complete. Streaming and non-streaming responses read the same pieces,
so their text is identical for the same request and seed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from mtplm.config import DecodeConfig
from mtplm.decode.constraints.constraint import Grammar
from mtplm.decode.run.engine import EngineClosed, Job
from mtplm.decode.run.steps import Step
from mtplm.decode.strategies import make_strategy
from mtplm.errors import UserError
from mtplm.serve.logprobs import LogprobWriter, merge
from mtplm.serve.protocol import APIError
from mtplm.serve.repository import Loaded
from mtplm.text import TextStream


@dataclass
class Choice:
    index: int
    prompt_tokens: int
    text: TextStream
    job: Job | None = None
    tokens: int = 0  # completion tokens (a final stop token not counted)
    emitted: int = 0  # every token the passes emitted, a stop token included
    passes: int = 0  # forward passes this sequence took part in
    drafted: int = 0
    accepted: int = 0
    forced: int = 0  # tokens a constraint forced (no pass chose them)
    finish_reason: str | None = None
    pieces: list[str] = field(default_factory=list)
    echo: str | None = None  # the prompt's text, sent before the completion (completions' `echo`)
    writer: LogprobWriter | None = None  # set when the request asked for logprobs
    logprobs: list[dict | None] = field(default_factory=list)  # each piece's entries

    def merged_logprobs(self) -> dict | None:
        return merge(self.logprobs, self.writer.chat) if self.writer is not None else None


@dataclass(frozen=True)
class Piece:
    choice: Choice
    text: str
    final: bool  # the choice's last piece: finish_reason is set
    logprobs: dict | None = None  # this piece's tokens' entries (serve/logprobs.py), if asked for


@dataclass(frozen=True)
class Options:
    """What a request asks of its answer beyond what it decodes (that is its DecodeConfig)."""

    stops: list[str] = field(default_factory=list)
    echo: list[str] | None = None  # per prompt: its text, sent before the completion
    chat: bool = False  # chat's logprob format (serve/logprobs.py)
    grammar: Grammar | None = None  # the output must match it (serve/structured.py); each sequence starts it
    tools: tuple[str, ...] = ()  # chat: the functions whose calls the reply parses (serve/structured.py)


class Run:
    """Submit every (prompt, n) sequence; `pieces()` yields their text as it is decoded."""

    def __init__(
        self,
        loaded: Loaded,
        prompts: list[list[int]],
        n: int,
        cfg: DecodeConfig,
        label: str,
        options: Options | None = None,
    ) -> None:
        options = options or Options()
        self.loaded, self.label, self.prompts, self._n = loaded, label, prompts, n
        self.tools = options.tools
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.started = time.perf_counter()
        self.first_token_s: float | None = None
        tokenizer = loaded.model.tokenizer
        self.choices = [
            Choice(
                i * n + j,
                len(ids),
                TextStream(tokenizer, options.stops),
                echo=options.echo[i] if options.echo is not None else None,
                writer=LogprobWriter(tokenizer, options.chat) if cfg.logprobs is not None else None,
            )
            for i, ids in enumerate(prompts)
            for j in range(n)
        ]
        jobs = [
            Job(
                ids,
                dataclasses.replace(cfg, seed=(cfg.seed + j) % 2**63),
                self._emitter(i * n + j),
                label=label,
                constraint=options.grammar.start() if options.grammar is not None else None,
            )
            for i, ids in enumerate(prompts)
            for j in range(n)
        ]
        try:
            for job in jobs:  # every choice's configuration is checked before any is submitted
                make_strategy(job.cfg, loaded.engine.spec.thresholds)
            for choice, job in zip(self.choices, jobs, strict=False):
                choice.job = loaded.engine.submit(job)
        except UserError as exc:
            self.cancel()
            raise APIError(400, str(exc), "mode", "invalid_mode") from None
        except EngineClosed:
            self.cancel()
            raise APIError(
                503,
                "the server is shutting down: retry on another replica",
                None,
                "shutting_down",
                "server_error",
            ) from None

    def _emitter(self, index: int):
        def emit(step: Step | None, error: BaseException | None) -> None:  # on the engine thread
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, step, error))
            except RuntimeError:  # the event loop is gone (server stopped): nobody is listening
                pass

        return emit

    async def pieces(self) -> AsyncIterator[Piece]:
        open_choices = len(self.choices)
        while open_choices:
            index, step, error = await self.queue.get()
            choice = self.choices[index]
            if choice.finish_reason is not None:
                continue  # already finished (a stop string); late steps of a cancelled job
            if error is not None:
                self.cancel()
                if isinstance(error, EngineClosed):
                    raise APIError(503, str(error), None, "shutting_down", "server_error")
                raise APIError(500, f"decoding failed: {error}", None, "decode_failed", "server_error")
            yield self._advance(choice, step)
            if choice.finish_reason is not None:
                open_choices -= 1

    def _advance(self, choice: Choice, step: Step) -> Piece:
        if self.first_token_s is None and step.tokens:
            self.first_token_s = time.perf_counter() - self.started
        choice.passes += 1
        choice.tokens += len(step.tokens) - (1 if step.stopped else 0)
        choice.emitted += len(step.tokens)
        choice.drafted += step.drafted
        choice.accepted += step.accepted
        choice.forced += step.forced
        text = choice.text.push(step.tokens)
        if choice.text.stopped:
            choice.finish_reason = "stop"
            if choice.job is not None:
                self.loaded.engine.cancel(choice.job)  # nothing after a stop string is needed
        elif step.last:
            text += choice.text.finish()
            choice.finish_reason = "stop" if step.stopped or choice.text.stopped else "length"
        scored = self._logprobs(choice, step)
        if choice.passes == 1 and choice.echo is not None:
            text = choice.echo + text
        choice.pieces.append(text)
        choice.logprobs.append(scored)
        return Piece(choice, text, choice.finish_reason is not None, scored)

    def _logprobs(self, choice: Choice, step: Step) -> dict | None:
        """This step's entries: the echoed prompt's first (completions), then the emitted tokens up to a
        stop string's cut; chat leaves out the end-of-sequence token, as its message does."""
        writer = choice.writer
        if writer is None:
            return None
        parts = []
        if step.prompt_logprobs is not None and choice.echo is not None:
            parts.append(writer.prompt(self.prompts[choice.index // self._n][0], step.prompt_logprobs))
        scored = list(step.logprobs or ())
        if writer.chat and step.stopped:
            scored = scored[:-1]
        echoed = len(choice.echo or "") if not writer.chat else 0
        limit = echoed + choice.text.released if choice.text.stopped else None
        parts.append(writer.tokens(scored, limit))
        return merge(parts, writer.chat)

    def cancel(self) -> None:
        for choice in self.choices:
            if choice.job is not None and choice.finish_reason is None:
                self.loaded.engine.cancel(choice.job)

    def usage(self, prompts: list[list[int]]) -> dict:
        completion = sum(c.tokens for c in self.choices)
        passes = sum(c.passes for c in self.choices)
        prompt = sum(len(ids) for ids in prompts)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "forward_passes": passes,
            "tokens_per_forward": round(sum(c.emitted for c in self.choices) / max(1, passes), 4),
            "drafted_tokens": sum(c.drafted for c in self.choices),
            "accepted_tokens": sum(c.accepted for c in self.choices),
            "forced_tokens": sum(c.forced for c in self.choices),
            "mode": self.label,
        }
