"""One registry per extension point: the single source of names for config validation, CLI help and docs.

Each registry knows the modules that fill it (`providers`) and imports them on first use, so this module
imports nothing of mtplm's and anything may look a name up (config/ validates against it) without an
import circle. An extension is one function or class plus one `register` line in its own module:

    @CONFIDENCE.register("margin", "top-1 minus top-2 probability")
    def margin_confidence(logits): ...

A test or a user package may register more entries at run time; they show up everywhere at once.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar

from mtplm.errors import UserError

T = TypeVar("T")


class Registry(Generic[T]):
    """Named entries of one kind, each with a one-line description."""

    def __init__(self, kind: str, *providers: str) -> None:
        self.kind = kind
        self._providers = providers
        self._loaded = False
        self._entries: dict[str, tuple[T, str]] = {}

    def register(self, name: str, description: str) -> Callable[[T], T]:
        """Decorator: add `entry` under `name` (a repeated name is a programming error)."""

        def add(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = (entry, description)
            return entry

        return add

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            for module in self._providers:
                importlib.import_module(module)

    def get(self, name: str) -> T:
        """The entry named `name`; a UserError naming the choices if there is none."""
        self.check(name)
        return self._entries[name][0]

    def check(self, name: str) -> str:
        self._load()
        if name not in self._entries:
            raise UserError(f"unknown {self.kind} {name!r}: choose one of {', '.join(self.names())}")
        return name

    def names(self) -> tuple[str, ...]:
        self._load()
        return tuple(self._entries)

    def describe(self) -> str:
        """`a (what a does) | b (what b does)`: for CLI help and docs."""
        self._load()
        return " | ".join(f"{name} ({description})" for name, (_, description) in self._entries.items())

    def choices(self) -> str:
        """`a | b | c`."""
        return " | ".join(self.names())


# decoding
STRATEGIES: Registry = Registry("decoding mode", "mtplm.decode.modes")  # the built-ins: one composition root
CONFIDENCE: Registry = Registry("confidence measure", "mtplm.decode.sampling")
WINDOWS: Registry = Registry("window policy", "mtplm.decode.windows")
PROPOSERS: Registry = Registry(
    "draft source", "mtplm.decode.drafts.lookup", "mtplm.decode.drafts.draft"
)  # text drafts (drafts/)
BACKENDS: Registry = Registry("backend", "mtplm.decode.passes.backends", "mtplm.decode.fast.variants")
# training
OBJECTIVES: Registry = Registry("objective", "mtplm.train.objectives")
TRAINABLE: Registry = Registry("trainable variant", "mtplm.train.recipes")
HEAD_FORMS: Registry = Registry("head form", "mtplm.heads.forms", "mtplm.heads.eagle3")  # model builders
# each head form's training function, under the form's name, registered beside the training code
HEAD_TRAINERS: Registry = Registry("head-form trainer", "mtplm.heads.train", "mtplm.heads.eagle3_train")
