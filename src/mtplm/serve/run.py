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
from mtplm.decode.engine import EngineClosed, Job
from mtplm.decode.loop import Step
from mtplm.errors import UserError
from mtplm.serve.protocol import APIError
from mtplm.serve.repository import Loaded
from mtplm.text import StreamDecoder


class TextStream:
    """Token blocks -> text pieces for one choice, cut at the first stop string."""

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.decoder = StreamDecoder(tokenizer)
        self.stops = stops
        self.held = ""  # decoded text not sent yet: it could be the start of a stop string
        self.stopped = False  # a stop string was found

    def push(self, tokens: list[int]) -> str:
        return self._release(self.held + self.decoder.push(tokens), final=False)

    def finish(self) -> str:
        return self._release(self.held + self.decoder.flush(), final=True)

    def _release(self, text: str, final: bool) -> str:
        if self.stopped:
            return ""
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.stopped, self.held = True, ""
            return text[: min(cuts)]
        keep = 0 if final else max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])),
                                   default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]


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
    finish_reason: str | None = None
    pieces: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Piece:
    choice: Choice
    text: str
    final: bool  # the choice's last piece: finish_reason is set


class Run:
    """Submit every (prompt, n) sequence; `pieces()` yields their text as it is decoded."""

    def __init__(self, loaded: Loaded, prompts: list[list[int]], n: int, cfg: DecodeConfig, stops: list[str],
                 label: str, ignore_eos: bool = False) -> None:
        self.loaded, self.label = loaded, label
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.started = time.perf_counter()
        self.first_token_s: float | None = None
        self.choices = [Choice(i * n + j, len(ids), TextStream(loaded.model.tokenizer, stops))
                        for i, ids in enumerate(prompts) for j in range(n)]
        jobs = [Job(ids, dataclasses.replace(cfg, seed=cfg.seed + j), self._emitter(i * n + j), label=label,
                    ignore_eos=ignore_eos)
                for i, ids in enumerate(prompts) for j in range(n)]
        try:
            for choice, job in zip(self.choices, jobs, strict=False):
                choice.job = loaded.engine.submit(job)
        except UserError as exc:
            self.cancel()
            raise APIError(400, str(exc), "mode", "invalid_mode") from None
        except EngineClosed:
            self.cancel()
            raise APIError(503, "the server is shutting down: retry on another replica", None, "shutting_down",
                           "server_error") from None

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
        text = choice.text.push(step.tokens)
        if choice.text.stopped:
            choice.finish_reason = "stop"
            if choice.job is not None:
                self.loaded.engine.cancel(choice.job)  # nothing after a stop string is needed
        elif step.last:
            text += choice.text.finish()
            choice.finish_reason = "stop" if step.stopped or choice.text.stopped else "length"
        choice.pieces.append(text)
        return Piece(choice, text, choice.finish_reason is not None)

    def cancel(self) -> None:
        for choice in self.choices:
            if choice.job is not None and choice.finish_reason is None:
                self.loaded.engine.cancel(choice.job)

    def usage(self, prompts: list[list[int]]) -> dict:
        completion = sum(c.tokens for c in self.choices)
        passes = sum(c.passes for c in self.choices)
        prompt = sum(len(ids) for ids in prompts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "forward_passes": passes,
                "tokens_per_forward": round(sum(c.emitted for c in self.choices) / max(1, passes), 4),
                "drafted_tokens": sum(c.drafted for c in self.choices),
                "accepted_tokens": sum(c.accepted for c in self.choices), "mode": self.label}
