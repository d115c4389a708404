"""Drafts from the grammar itself, as two proposers (proposers.py): the bytes it forces where its tokens are
not forced (`ForcedRun`), and a JSON schema's own strings, its property names and its string `enum` /
`const` values (`SchemaLiterals`); `grammar_drafts` offers them to a plan with nothing to verify.

Where the grammar lets the model choose (an enum value, an optional property's key), the choice is often
one of the schema's strings, and the text the grammar forces after it follows for free (hook.py's
jump-forward). So when a drafting strategy has nothing to propose there, each string's tokens (bare, as a
JSON string, and after a space, since a tokenizer may spell each differently) are tried against the grammar
(`Constraint.accepts`, which does not move it); the drafts are one the grammar takes whole, preferring one
the text so far already holds (a prompt names the value it wants), else the longest, else the first in the
schema. Verification keeps them only where the model agrees, so the output never changes.

Shapes: none (token ids).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from functools import lru_cache
from typing import Any

from mtplm.decode.drafts.proposers import Context, Drafts, first_offer
from mtplm.decode.protocol import Plan

MAX_STRINGS = 64  # schema strings kept (the first found): trying them costs a grammar check each
MAX_TOKENS = 16  # tokens per string kept
NARROW = 256  # a position allowing more next tokens than this is free text, not a choice among strings


def schema_strings(schema: Any, found: list[str] | None = None) -> list[str]:
    """Property names and string enum/const values of a schema, depth first, each once, in order."""
    found = [] if found is None else found
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key == "properties" and isinstance(value, dict):
                found.extend(name for name in value if name not in found)
            if key in ("enum", "const"):
                for item in value if key == "enum" and isinstance(value, list) else [value]:
                    if isinstance(item, str) and item not in found:
                        found.append(item)
            elif isinstance(value, dict | list):
                schema_strings(value, found)
    elif isinstance(schema, list):
        for item in schema:
            schema_strings(item, found)
    return found[:MAX_STRINGS]


def literal_drafts(source: str, tokenizer) -> list[tuple[int, ...]]:
    """Token spellings of a JSON schema's strings (`source` is its JSON text): each string bare, quoted, and
    quoted after a space; empty for text that is not a JSON object."""
    try:
        schema = json.loads(source)
    except ValueError:
        return []
    out: list[tuple[int, ...]] = []
    for text in schema_strings(schema):
        quoted = json.dumps(text)
        for spelling in (text, quoted, " " + quoted):
            ids = tuple(tokenizer(spelling, add_special_tokens=False)["input_ids"][:MAX_TOKENS])
            if ids and ids not in out:
                out.append(ids)
    return out


def spelling(tokenizer) -> Callable[[bytes], tuple[int, ...]]:
    """bytes -> the tokenizer's tokens for them, cached (() for bytes that end inside a character). Holds the
    tokenizer weakly: grammars are cached per tokenizer, weakly keyed by it."""
    ref = weakref.ref(tokenizer)

    @lru_cache(maxsize=4096)
    def spell(data: bytes) -> tuple[int, ...]:
        found = ref()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return ()
        if found is None or not text:
            return ()
        return tuple(found(text, add_special_tokens=False)["input_ids"])

    return spell


def pruned(constraint, plan: Plan, budget: int, stop_ids: Collection[int]) -> Plan:
    """The plan's draft chain cut at its first token the grammar rejects (verification could never keep it
    nor anything after it); a chain without blocks (copied drafts) then extended by the tokens the grammar
    forces after it (drafts the masked rows cannot reject: the pass's new token lands after them, not on
    them) and the spelling of the bytes it forces (`Constraint.forced_after`'s `likely`), or replaced by
    that run from here where it spells the forced text otherwise. Greedy or copied chains only
    (docs/structured.md: cutting a sampled draft would not be exact)."""
    if plan.parents is not None or plan.proposal is not None or not plan.drafts:
        return plan
    kept = plan.drafts[: constraint.accepts(plan.drafts)]
    if kept and kept[-1] in stop_ids:
        return replace(plan, drafts=kept)
    if plan.slots:
        return plan if len(kept) == len(plan.drafts) else replace(plan, drafts=kept)
    # forced tokens are left to jump-forward (hook.py); the spelling of forced bytes is preferred to a copy
    # that spells them otherwise (a model spells them as its tokenizer does)
    likely = () if constraint.forced() else tuple(constraint.forced_after((), likely=True))
    common = min(len(likely), len(kept))
    if kept[:common] != likely[:common]:
        kept = likely
    if kept:
        kept += tuple(constraint.forced_after(kept, likely=True))
    kept = kept[: max(0, budget - 1)]
    return replace(plan, k=max(plan.k, 1 + len(kept)), drafts=kept)


class ForcedRun:
    """Proposer: the tokens spelling the bytes the grammar forces next (` "` before a string value, ` `
    before a number: the text is certain but its tokens are not, since a longer token could start it) and
    what it forces after them, as drafts the model verifies (so its token lands after them)."""

    def __init__(self, constraint) -> None:
        self.constraint = constraint

    def propose(self, context: Context, room: int) -> Drafts:
        return Drafts(tuple(self.constraint.forced_after((), likely=True)[: max(0, room)]))

    def observe(self, kept: int) -> None:
        return None


class SchemaLiterals:
    """Proposer: at a choice point (the grammar allows at most NARROW tokens next: an enum value, a key; not
    the middle of a free string), one of the schema's strings the grammar accepts here, then the tokens it
    forces after it, as drafts (kept only where the model agrees)."""

    def __init__(self, constraint) -> None:
        self.constraint = constraint

    def propose(self, context: Context, room: int) -> Drafts:
        constraint, room = self.constraint, max(0, room)
        literals = constraint.grammar.literals
        if not literals or int(constraint.mask().sum()) > NARROW:
            return Drafts()
        drafts = list(pick(constraint, literals, context.text))[:room]
        if not drafts:
            return Drafts()
        drafts += constraint.forced_after(drafts, likely=True)[: max(0, room - len(drafts))]
        return Drafts(tuple(drafts))

    def observe(self, kept: int) -> None:
        return None


def grammar_drafts(constraint, plan: Plan, text: Sequence[int], budget: int) -> Plan:
    """A verifying chain plan with nothing to propose gets the grammar's drafts: the spelling of the bytes
    it forces, else one of the schema's strings (proposers.first_offer); any other plan as it is."""
    proposers = (ForcedRun(constraint), SchemaLiterals(constraint))
    return first_offer(plan, proposers, Context(text), budget)


def pick(constraint, literals: Sequence[tuple[int, ...]], text: Sequence[int]) -> tuple[int, ...]:
    """The literal to draft after `text` under `constraint`: one the grammar accepts whole (none: ())."""
    fits = [lit for lit in literals if constraint.accepts(lit) == len(lit)]
    if len(fits) <= 1:
        return fits[0] if fits else ()
    seen = [lit for lit in fits if _occurs(lit, text)]
    return max(seen or fits, key=len)


def _occurs(tokens: tuple[int, ...], text: Sequence[int]) -> bool:
    """`tokens` stand somewhere in `text`: list.index finds each candidate start at C speed (the text holds
    the prompt: thousands of tokens, searched at every choice point)."""
    words, n, at = text if isinstance(text, list) else list(text), len(tokens), -1
    while True:
        try:
            at = words.index(tokens[0], at + 1)
        except ValueError:
            return False
        if tuple(words[at : at + n]) == tokens:
            return True
