"""Text <-> tokens: a prompt in the model's chat format, and token blocks -> text for streaming (never split a
UTF-8 character, never drop or repeat a token)."""

from __future__ import annotations

from mtplm.errors import UserError

CONTEXT_TOKENS = 6  # tokens decoded before the new ones, so tokenizers that space by context space right


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
        return text[len(before):]

    def _decode(self, start: int, stop: int) -> str:
        return self.tokenizer.decode(self.tokens[start:stop], skip_special_tokens=self.skip) if stop > start else ""


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    if not prompt.strip():
        raise UserError("the prompt is empty: give some text to answer")
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]
