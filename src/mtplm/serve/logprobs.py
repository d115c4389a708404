"""Token log-probabilities in OpenAI's two wire formats, built piece by piece.

/v1/completions (the legacy format, as vLLM returns it): {"tokens", "token_logprobs", "top_logprobs",
"text_offset"} lists, the prompt's tokens first with `echo` (the first prompt token scores null, having
no context), the final end-of-sequence token included (lm-eval's loglikelihood reads every entry but the
last). /v1/chat/completions: {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}, the
end-of-sequence token left out as it is from the message. Both carry mtplm's extra `exact` marker:
False for a token a lossy mode (static, ConfAdapt) emitted from a mask slot, whose value comes from the
slot's logits rather than the model's next-token distribution (decode/run/logprobs.py).

A streamed response sends each piece's entries with its chunk; the non-streamed one is the same pieces
merged, so the two agree. -inf (the <mtp> token) is sent as -9999.0, since JSON has no infinities.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mtplm.decode.run.logprobs import TokenLogprob

FLOOR = -9999.0


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


class LogprobWriter:
    """One choice's logprob entries; `offset` counts the characters of the token strings written so far."""

    def __init__(self, tokenizer, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self.offset = 0

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def prompt(self, first: int, scored: Sequence[TokenLogprob]) -> dict:
        """Echoed prompt tokens (completions): the first one unscored, then `scored` (tokens 1..)."""
        head = self._legacy([TokenLogprob(first, math.nan, ())])
        head["token_logprobs"], head["top_logprobs"] = [None], [None]
        merged = merge([head, self._legacy(scored)], chat=False)
        assert merged is not None
        return merged

    def tokens(self, scored: Sequence[TokenLogprob], limit: int | None = None) -> dict:
        """The entries of one piece; with `limit`, only tokens that start before that many characters
        (a stop string cut the text there)."""
        if limit is not None:
            kept, at = [], self.offset
            for item in scored:
                if at >= limit:
                    break
                kept.append(item)
                at += len(self.text(item.token))
            scored = kept
        return self._chat(scored) if self.chat else self._legacy(scored)

    def _legacy(self, scored: Sequence[TokenLogprob]) -> dict:
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": [], "exact": []}
        for item in scored:
            token = self.text(item.token)
            out["tokens"].append(token)
            out["token_logprobs"].append(_value(item.logprob))
            alternatives: dict[str, float] = {}
            for alt, logprob in item.top:
                alternatives.setdefault(self.text(alt), _value(logprob))
            out["top_logprobs"].append(alternatives)
            out["text_offset"].append(self.offset)
            out["exact"].append(item.exact)
            self.offset += len(token)
        return out

    def _chat(self, scored: Sequence[TokenLogprob]) -> dict:
        content = []
        for item in scored:
            token = self.text(item.token)
            self.offset += len(token)
            content.append(
                {
                    **self._entry(item.token, item.logprob),
                    "exact": item.exact,
                    "top_logprobs": [self._entry(alt, logprob) for alt, logprob in item.top],
                }
            )
        return {"content": content, "refusal": None}

    def _entry(self, token: int, logprob: float) -> dict:
        text = self.text(token)
        return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8"))}


def merge(parts: Sequence[dict | None], chat: bool) -> dict | None:
    """Pieces' entries as one (a non-streamed response); None when no piece had any."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    if chat:
        return {"content": [entry for p in present for entry in p["content"]], "refusal": None}
    return {key: [value for p in present for value in p[key]] for key in present[0]}
