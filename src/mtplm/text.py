"""Text <-> tokens: a prompt in the model's chat format, and token blocks -> text for streaming (never split a
UTF-8 character, never drop or repeat a token, cut at the first stop string)."""

from __future__ import annotations

from mtplm.errors import UserError

CONTEXT_TOKENS = 6  # tokens decoded before the new ones, so tokenizers that space by context space right
MAX_STOP_CHARS = (
    4096  # longest stop string accepted: the server holds back up to this much text while it may match
)


class StreamDecoder:
    """Hands out the text of each new block of tokens as soon as its characters are complete.

    Each push decodes only a short window: the last few tokens already handed out (for context) plus
    the new ones, and emits what the new ones add. A byte-level BPE token can end in the middle of a
    multi-byte character; the tokenizer then renders U+FFFD at the end, so those tokens wait for the
    next block to complete them (or for `flush`). Cost per push is O(window), not O(text so far).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.tokens: list[int] = []
        self.prefix = 0  # first token of the context window
        self.read = 0  # tokens whose text has been handed out

    def push(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self._decode(self.prefix, self.read)
        text = self._decode(self.prefix, len(self.tokens))
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""  # nothing new, or a character still incomplete: wait for more tokens
        self.read = len(self.tokens)
        self.prefix = max(0, self.read - CONTEXT_TOKENS)
        return text[len(before) :]

    def _decode(self, start: int, stop: int) -> str:
        return (
            self.tokenizer.decode(self.tokens[start:stop], skip_special_tokens=self.skip)
            if stop > start
            else ""
        )


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    if not prompt.strip():
        raise UserError("the prompt is empty: give some text to answer")
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


EVAL_PROMPT_TOKENS = 768  # an eval prompt keeps its last this many tokens (bench, calibrate, held-out score)


def eval_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """An eval prompt as every measurement decodes it: the chat prompt's last EVAL_PROMPT_TOKENS tokens."""
    return chat_prompt_ids(tokenizer, prompt)[-EVAL_PROMPT_TOKENS:]


class StopMatcher:
    """Finds the first of a few stop strings in text that arrives in pieces.

    One KMP automaton per stop string: its state is how many characters of the stop string the text
    so far ends with, so each piece costs O(len(piece)) per stop string (amortized), however long the
    stop strings are or however much text came before; a naive `endswith` over every prefix costs O(L^2).
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.failure = [_failure(s) for s in self.stops]
        self.state = [0] * len(self.stops)  # characters of each stop string matched at the end of the text

    @property
    def hold(self) -> int:
        """Characters at the end of the text that could still begin a stop string."""
        return max(self.state, default=0)

    def feed(self, piece: str, before: int) -> int | None:
        """Advance over `piece`, which follows `before` held characters: where (counted from the start of
        the held text) the earliest stop string found starts, or None."""
        starts = []
        for n, stop in enumerate(self.stops):
            state, failure = self.state[n], self.failure[n]
            for i, ch in enumerate(piece):
                while state and stop[state] != ch:
                    state = failure[state - 1]
                state += stop[state] == ch
                if state == len(stop):
                    starts.append(before + i + 1 - len(stop))
                    break
            self.state[n] = state
        return min(starts) if starts else None


def _failure(stop: str) -> list[int]:
    """KMP's table: failure[i] = the longest proper prefix of stop[:i+1] that is also its suffix."""
    failure, state = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while state and stop[i] != stop[state]:
            state = failure[state - 1]
        state += stop[i] == stop[state]
        failure[i] = state
    return failure


class TextStream:
    """Token blocks -> text pieces for one choice, cut at the first stop string (StopMatcher)."""

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.decoder = StreamDecoder(tokenizer)
        self.matcher = StopMatcher(stops)
        self.held = ""  # decoded text not sent yet: it could be the start of a stop string
        self.stopped = False  # a stop string was found
        self.released = 0  # characters handed out so far

    def push(self, tokens: list[int]) -> str:
        return self._release(self.decoder.push(tokens), final=False)

    def finish(self) -> str:
        return self._release(self.decoder.flush(), final=True)

    def _release(self, piece: str, final: bool) -> str:
        if self.stopped:
            return ""
        text = self.held + piece
        cut = self.matcher.feed(piece, len(self.held))
        if cut is not None:
            self.stopped, self.held = True, ""
            out = text[:cut]
        else:
            keep = 0 if final else min(self.matcher.hold, len(text))
            self.held = text[len(text) - keep :] if keep else ""
            out = text[: len(text) - keep]
        self.released += len(out)
        return out
