"""Constrained decoding: a grammar's token mask over the next position (llguidance; docs/structured.md).

A `Spec` names what the output must match: a JSON schema, any JSON object, a regular expression, or a
Lark/GBNF grammar. `compile(spec, tokenizer, stop_ids)` checks it and returns a `Grammar` (cached per
tokenizer and spec, so a schema sent again compiles once); `Grammar.start()` gives one sequence's
`Constraint`, which says which tokens may come next (`mask`, `apply`), advances on the tokens the
sequence commits (`advance`), says how many leading drafts the grammar accepts without moving
(`accepts`), the masks along a draft chain or tree (`masks_along`), the tokens the grammar forces
(`forced`: its unique continuation), and whether the output is complete (`accepting`).

Stop tokens (the model's end-of-sequence ids) are the grammar's end: allowed exactly where the output is
complete, and never fed to the engine.

Shapes: V vocabulary (the logits' width; the tokenizer's ids are its first columns).
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from functools import cached_property
from typing import Any

import numpy as np
import torch

from mtplm.decode.constraints.drafts import literal_drafts, spelling
from mtplm.decode.constraints.spec import KINDS, Spec, any_json_object, ascii_classes, json_schema
from mtplm.decode.protocol import Outcome, PassLogits
from mtplm.errors import UserError

__all__ = ["KINDS", "Spec", "json_schema", "compile", "Grammar", "Constraint", "ConstrainedLogits", "trim"]

MAX_SOURCE_CHARS = 100_000  # a schema, regex or grammar longer than this is refused before compiling
# compact JSON with the separators models write most ("a": 1, "b": 2): no free whitespace, so keys,
# braces and separators are forced; a schema's own "x-guidance" options override these
JSON_OPTIONS: Any = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def _grammar_text(spec: Spec) -> str:
    """The engine's grammar for a spec (no validation yet)."""
    import llguidance

    if len(spec.source) > MAX_SOURCE_CHARS:
        raise UserError(
            f"{spec.name}: {len(spec.source)} characters is too large (at most {MAX_SOURCE_CHARS})"
        )
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(any_json_object(), defaults=JSON_OPTIONS)
    if spec.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(ascii_classes(spec.source))
    return llguidance.grammar_from("grammar", spec.source)


# per tokenizer object (weakly: a model the server unloads takes its entries with it; an id could be reused)
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {stop ids: LLTokenizer}
_GRAMMARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {(stop ids, Spec): Grammar}
_LOCK = threading.Lock()
MAX_CACHED = 256  # compiled grammars kept per tokenizer (the oldest is dropped first)


def _ll_tokenizer(tokenizer, stop_ids: frozenset[int]):
    """llguidance's view of a Hugging Face tokenizer, once per tokenizer (about 0.25 s for 49k tokens)."""
    import llguidance.hf

    with _LOCK:
        found = _TOKENIZERS.get(tokenizer, {}).get(stop_ids)
    if found is None:
        eos = sorted(stop_ids) if stop_ids else None
        found = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=eos)
        with _LOCK:
            _TOKENIZERS.setdefault(tokenizer, {})[stop_ids] = found
    return found


def compile(spec: Spec, tokenizer, stop_ids: Iterable[int]) -> Grammar:
    """The compiled grammar for `spec` over `tokenizer` (cached); a UserError names what is wrong with it."""
    stops = frozenset(stop_ids)
    with _LOCK:
        found = _GRAMMARS.get(tokenizer, {}).get((stops, spec))
    if found is not None:
        return found
    try:
        engine_tokenizer = _ll_tokenizer(tokenizer, stops)
    except (
        ValueError,
        TypeError,
        AttributeError,
    ) as exc:  # llguidance reads byte-level and sentencepiece kinds
        raise UserError(
            f"{spec.name}: this model's tokenizer is not one the grammar engine can read "
            f"({_one_line(str(exc))})"
        ) from None
    grammar = Grammar(spec, engine_tokenizer, stops, len(tokenizer), tokenizer.eos_token_id)
    grammar.spell = spelling(tokenizer)  # forced bytes as drafts (Constraint.forced_after)
    if spec.kind == "json_schema":  # the schema's own strings, as drafts (constraints/drafts.py)
        grammar.literals = literal_drafts(spec.source, tokenizer)
    with _LOCK:
        cached = _GRAMMARS.setdefault(tokenizer, {})
        if len(cached) >= MAX_CACHED:
            cached.pop(next(iter(cached)))
        cached[(stops, spec)] = grammar
    return grammar


def _one_line(message: str) -> str:
    """The engine's message on one line: its first line, and the reason a regex parser gives below it."""
    lines = [line.strip() for line in message.strip().splitlines()] or ["rejected by the grammar engine"]
    reason = next((line for line in lines[1:] if line.startswith("error:")), None)
    first = re.sub(r"^at \d+\(\d+\): ", "", lines[0]) + (f" {reason}" if reason else "")
    return first[:300]


class Grammar:
    """A checked grammar over one tokenizer: `start()` gives each sequence its own Constraint."""

    def __init__(
        self, spec: Spec, ll_tokenizer, stop_ids: frozenset[int], vocab: int, end_token: int | None = None
    ) -> None:
        import llguidance

        self.spec, self.stop_ids, self.vocab = spec, stop_ids, vocab
        self.literals: list[tuple[int, ...]] = []  # token spellings of a JSON schema's strings (compile sets)
        self.spell: Callable[[bytes], tuple[int, ...]] | None = None  # bytes -> tokens (compile sets)
        # the stop token emitted when the grammar is finished and allows nothing else (hook.py): the
        # tokenizer's end of sequence where it is a stop id, else the smallest stop id
        self.end_token = end_token if end_token in stop_ids else min(stop_ids, default=-1)
        try:
            text = _grammar_text(spec)
        except ValueError as exc:
            raise UserError(f"{spec.name}: {_one_line(str(exc))}") from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, ll_tokenizer)
        if failed:
            raise UserError(f"{spec.name}: {_one_line(messages[0] if messages else '')}")
        self._matcher = llguidance.LLMatcher(ll_tokenizer, text, log_level=0)
        if self._matcher.is_error():
            raise UserError(f"{spec.name}: {_one_line(self._matcher.get_error())}")
        first = self.start()
        allowed = bool(first.mask().any())  # computing the first mask is what finds an empty language
        if first._m.is_error() or (not first.accepting and not allowed):
            raise UserError(f"{spec.name}: matches no text at all (nothing can be generated under it)")

    def start(self, jump_forward: bool = True) -> Constraint:
        """A sequence's constraint at the start; `jump_forward=False` has the loop spend a pass on every
        token, forced ones too (a baseline: what a server without jump-forward does)."""
        constraint = Constraint(self, self._matcher.deep_copy())
        constraint.jump_forward = jump_forward
        return constraint


def _unpack(bits: np.ndarray, vocab: int) -> torch.Tensor:
    """llguidance's bitmask (int32 words, bit i of word w: token 32w+i) -> bool [vocab]."""
    return torch.from_numpy(np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab].astype(bool))


class Constraint:
    """One sequence's position in its grammar. Not thread-safe: one decoding thread owns it."""

    def __init__(self, grammar: Grammar, matcher) -> None:
        self.grammar, self._m = grammar, matcher
        self._words = (grammar.vocab + 31) // 32
        self._mask: torch.Tensor | None = None  # of the current state
        self.jump_forward = True  # the loop takes forced runs and the forced end without a pass (hook.py)

    @property
    def accepting(self) -> bool:
        """The output so far is complete: a stop token may end it here."""
        return bool(self._m.is_accepting())

    @property
    def finished(self) -> bool:
        """Nothing but a stop token can follow (the grammar is complete and allows no more text)."""
        return bool(self._m.is_stopped())

    def mask(self) -> torch.Tensor:
        """bool [vocab]: the tokens allowed next (the stop tokens exactly when the output is complete)."""
        if self._mask is None:
            bits = np.empty(self._words, dtype=np.int32)
            self._m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
            self._mask = _unpack(bits, self.grammar.vocab)
        return self._mask

    def allowed(self, token: int) -> bool:
        return 0 <= token < self.grammar.vocab and bool(self.mask()[token])

    def apply(self, logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """logits [..., V] with every disallowed token at -inf (a new tensor; V may exceed the vocabulary)."""
        mask = self.mask() if mask is None else mask
        width = logits.shape[-1]
        keep = torch.zeros(width, dtype=torch.bool, device=logits.device)
        keep[: min(width, len(mask))] = mask[:width].to(logits.device)
        return logits.masked_fill(~keep, float("-inf"))

    def advance(self, tokens: Sequence[int]) -> int:
        """Commit tokens: how many the grammar took (it stops at the first it rejects, or at a stop token,
        which ends the output and is not fed to the engine)."""
        taken = 0
        for token in tokens:
            if token in self.grammar.stop_ids:
                return taken + int(self.accepting)
            if not self.allowed(token) or not self._m.consume_token(token):
                return taken
            self._mask, taken = None, taken + 1
        return taken

    def accepts(self, tokens: Sequence[int]) -> int:
        """How many leading tokens the grammar would accept from here (a stop token only where complete);
        the state does not move."""
        if not tokens:
            return 0
        plain = list(tokens)
        stop = next((i for i, t in enumerate(plain) if t in self.grammar.stop_ids), None)
        if stop is not None:
            plain = plain[:stop]
        valid = int(self._m.validate_tokens(plain)) if plain else 0
        if stop is not None and valid == stop and self._accepting_after(plain):
            return valid + 1
        return valid

    def _accepting_after(self, tokens: list[int]) -> bool:
        if not tokens:
            return self.accepting
        self._m.consume_tokens(tokens)
        done = self.accepting
        self._m.rollback(len(tokens))
        return done

    def masks_along(
        self, drafts: Sequence[int], parents: Sequence[int] | None = None
    ) -> list[torch.Tensor | None]:
        """The masks of a pass's next-token rows: row 0 after the committed text, row i+1 after draft i
        (a chain, or a tree: node i follows parents[i], -1 the committed text). A row whose path the grammar
        rejects gets None: verification can never reach it (its draft is not its parent's allowed token)."""
        parents = list(parents) if parents is not None else list(range(-1, len(drafts) - 1))
        rows: list[torch.Tensor | None] = [self.mask()] + [None] * len(drafts)
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(parents):
            children.setdefault(parent, []).append(i)
        self._walk(-1, list(drafts), children, rows)
        self._mask = rows[0]
        return rows

    def _walk(
        self, node: int, drafts: list[int], children: dict[int, list[int]], rows: list[torch.Tensor | None]
    ) -> None:
        """Depth first from `node` (its mask in rows[node + 1]): each child's mask, then its subtree."""
        parent_mask = rows[node + 1]
        assert parent_mask is not None
        for child in children.get(node, []):
            token = drafts[child]
            if token in self.grammar.stop_ids or not bool(
                parent_mask[token] if token < len(parent_mask) else 0
            ):
                continue
            if not self._m.consume_token(token):
                continue
            self._mask = None
            rows[child + 1] = self.mask()
            self._walk(child, drafts, children, rows)
            self._m.rollback(1)
            self._mask = None

    def mask_chain(self, rows: torch.Tensor, prefix: Sequence[int]) -> torch.Tensor:
        """rows [n, V] of a block that follows `prefix`, each masked by the grammar's state after the prefix
        and the argmax tokens of the rows before it (the block's own greedy drafts); rows after a stop token,
        or all rows when the grammar rejects the prefix, stay as they were. The state does not move."""
        consumed, out, root = 0, rows.clone(), self._mask
        try:
            for token in prefix:
                if (
                    token in self.grammar.stop_ids
                    or not self.allowed(token)
                    or not self._m.consume_token(token)
                ):
                    return rows
                self._mask, consumed = None, consumed + 1
            for j in range(len(rows)):
                out[j] = self.apply(rows[j])
                token = int(out[j].argmax())
                if (
                    token in self.grammar.stop_ids
                    or not self.allowed(token)
                    or not self._m.consume_token(token)
                ):
                    break
                self._mask, consumed = None, consumed + 1
            return out
        finally:
            if consumed:
                self._m.rollback(consumed)
            self._mask = root

    def forced(self) -> list[int]:
        """The tokens the grammar allows as its only continuation from here (none: [])."""
        if self.finished:
            return []
        return [int(t) for t in self._m.compute_ff_tokens()]

    def forced_after(self, tokens: Sequence[int] = (), likely: bool = False, most: int = 32) -> list[int]:
        """The tokens the grammar forces after `tokens` (which it must accept, no stop token among them); with
        `likely`, then the tokens spelling the bytes it forces beyond them (` "` before a string: a longer
        token could start the same way, so these are drafts, not forced), what it forces after those, and
        so on; at most `most`. The state does not move."""
        if tokens and not self._m.consume_tokens(list(tokens)):
            return []
        out: list[int] = []
        try:
            while len(out) < most and not self._m.is_stopped():
                run = [int(t) for t in self._m.compute_ff_tokens()]
                if not run and likely and self.grammar.spell is not None:
                    run = list(self.grammar.spell(bytes(self._m.compute_ff_bytes())))
                taken = int(self._m.try_consume_tokens(run)) if run else 0
                out += run[:taken]
                if not taken or not likely:
                    break
            return out[:most]
        finally:
            self._m.rollback(len(tokens) + len(out))

    def finishes(self, tokens: Sequence[int]) -> bool:
        """After `tokens` nothing but a stop token can follow (False where the grammar rejects them); the
        state does not move."""
        taken = int(self._m.try_consume_tokens(list(tokens))) if tokens else 0
        try:
            return taken == len(tokens) and bool(self._m.is_stopped())
        finally:
            if taken:
                self._m.rollback(taken)

    def copy(self) -> Constraint:
        copied = Constraint(self.grammar, self._m.deep_copy())
        copied.jump_forward = self.jump_forward
        return copied


class ConstrainedLogits(PassLogits):
    """A pass's logits under a constraint: each next-token row masked by the grammar's state after the
    committed text and the drafts on its path, so every strategy's target is the constrained distribution
    (a row whose path the grammar rejects stays as it was: no strategy can reach it). A lossy strategy's
    block is masked along its own greedy chain, so its slot tokens stay inside the grammar; the loop masks a
    drafting strategy's block along the kept path and the chosen token (Constraint.mask_chain)."""

    def __init__(self, constraint: Constraint, drafts: Sequence[int], *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.constraint, self.draft_tokens = constraint, list(drafts)
        self.forced_rows: list[bool] = []

    @cached_property
    def next_token(self) -> torch.Tensor:
        rows = self._next_rows().clone()  # penalized first, when the request has penalties
        masks = self.constraint.masks_along(self.draft_tokens, self.feed.parents)
        for i, mask in enumerate(masks):
            if mask is not None:
                rows[i] = self.constraint.apply(rows[i], mask)
        self.forced_rows = [mask is not None and int(mask.sum()) == 1 for mask in masks]
        return rows

    def forced_among(self, outcome: Outcome, emitted: int) -> int:
        """How many of the first `emitted` tokens of this pass (kept drafts, then the new tokens) the grammar
        forced: chosen at a next-token row where it allows exactly one token."""
        _ = self.next_token  # computes forced_rows
        rows = [0] + [
            i + 1 for i in outcome.path
        ]  # the row each kept draft, then the first new token, came from
        return sum(self.forced_rows[r] for r in rows[: min(emitted, len(rows))])

    def candidates(self) -> torch.Tensor:
        """The lossy strategies' next token and block, the block masked along its greedy chain."""
        rows = super().candidates()
        if len(rows) <= 1:
            return rows
        chain = [*self._path(self.feed.drafts - 1), int(rows[0].argmax())]
        return torch.cat([rows[:1], self.constraint.mask_chain(rows[1:], chain)])

    def _path(self, anchor: int) -> list[int]:
        """The drafts the committed text would end with if draft `anchor` were kept (-1: none)."""
        parents = self.feed.parents
        if parents is None:
            return self.draft_tokens[: anchor + 1]
        path: list[int] = []
        while anchor >= 0:
            path.insert(0, self.draft_tokens[anchor])
            anchor = parents[anchor]
        return path


def trim(outcome: Outcome, kept: Sequence[int], constraint: Constraint) -> Outcome:
    """The outcome cut where the grammar rejects a new token (a lossy block's slot token outside the grammar
    ends its run; kept drafts and the first new token, chosen from masked rows, always pass)."""
    valid = constraint.accepts([*kept, *outcome.new]) - len(kept)
    if valid >= len(outcome.new):
        return outcome
    # the drafts that followed the cut run follow text that is no longer committed: none are kept
    return outcome.replace(new=outcome.new[: max(1, valid)], drafts=(), proposal=None)
