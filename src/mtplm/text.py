"""Token blocks -> text for streaming: never split a UTF-8 character, never drop or repeat a token."""

from __future__ import annotations


class StreamDecoder:
    """Decodes the whole emitted sequence each time and hands out only the new, complete characters.

    A byte-level BPE token can end in the middle of a multi-byte character; the tokenizer then renders
    U+FFFD at the end, so that tail is held back until the next block completes it (or `flush`).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.tokens: list[int] = []
        self.sent = 0  # characters already handed out

    def push(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=self.skip)
        stable = len(text.rstrip("\ufffd"))
        piece, self.sent = text[self.sent : stable], max(self.sent, stable)
        return piece

    def flush(self) -> str:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=self.skip)
        piece, self.sent = text[self.sent :], len(text)
        return piece
