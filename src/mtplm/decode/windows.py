"""Window policies: how many tokens one verified pass may emit (its k), from the context and past acceptance.

fixed      k_max
context    min(k_max, len(context) // 2 + 1)
adaptive   one more after a pass that keeps all its drafts, back to kept + 2 after a rejection
"""

from __future__ import annotations

from mtplm.registry import WINDOWS


@WINDOWS.register("fixed", "always k_max")
class FixedWindow:
    def __init__(self, k_max: int) -> None:
        self.k_max = k_max

    def size(self, context_len: int) -> int:
        return self.k_max

    def update(self, drafted: int, kept: int) -> None:
        pass


@WINDOWS.register("context", "min(k_max, len(context)//2 + 1)")
class ContextWindow(FixedWindow):
    def size(self, context_len: int) -> int:
        return min(self.k_max, context_len // 2 + 1)


@WINDOWS.register("adaptive", "grows after full acceptance, shrinks after a rejection")
class AdaptiveWindow(FixedWindow):
    def __init__(self, k_max: int) -> None:
        super().__init__(k_max)
        self.k = k_max

    def size(self, context_len: int) -> int:
        return self.k

    def update(self, drafted: int, kept: int) -> None:
        if kept == drafted and drafted >= self.k - 1:
            self.k = min(self.k_max, self.k + 1)
        elif kept < drafted:
            self.k = max(2, min(self.k_max, kept + 2))
