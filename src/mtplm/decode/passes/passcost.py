"""The pass-cost curve c(rows) of this machine: seconds of one decode pass that feeds `rows` rows (one token
and rows-1 <mtp> slots, the passes of ConfAdapt and verified) behind a cached context, LM head included; and,
where measured, the same for passes of real rows only (drafts copied from the text,
decode/drafts/lookup.py), which run no adapters and which a CPU prices near a one-row pass.

A mode's served speedup over plain decoding is then tokens x c(1) / (the sum of c(rows) over its passes)
(train/predict.py); that is how tokens/pass turns into wall-clock speed on the machine at hand.
`scripts/pass_cost.py --json FILE` writes a curve for any backend (compiled included); `measure` here times
the eager backend in a few seconds, which is what a training run does when pass_cost=measure.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mtplm.errors import UserError

ROWS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class PassCost:
    rows: tuple[int, ...]  # increasing row counts, starting at 1
    seconds: tuple[float, ...]  # best-of-repeats seconds per pass at each
    backend: str = "eager"
    context: int = 200
    plain_seconds: tuple[float, ...] | None = None  # the same row counts, real rows only (no <mtp> rows)

    def __call__(self, n: int, masked: bool = True) -> float:
        """c(n), linear between measured row counts and beyond the last two; `masked` False: a pass of real
        rows only (the plain curve where measured, else the <mtp> one, an upper bound)."""
        rows = self.rows
        secs = self.seconds if masked or self.plain_seconds is None else self.plain_seconds
        i = next((j for j in range(1, len(rows)) if n <= rows[j]), len(rows) - 1)
        if i == 0:
            return secs[0]
        slope = (secs[i] - secs[i - 1]) / (rows[i] - rows[i - 1])
        return max(secs[0], secs[i - 1] + slope * (n - rows[i - 1]))

    def relative(self, n: int, masked: bool = False, exact: bool = False) -> float:
        """A pass of n real rows (`masked`: a token and n-1 <mtp> rows) against a one-row pass, as a compiled
        backend pays it: the curve at the smallest measured row count >= n (a pass is padded to its row
        bucket, and the curve is measured at the buckets), the last measured step's slope beyond the last;
        `exact`, where the backend feeds n rows unpadded: the curve at n itself, linear between measured
        row counts. The draft budget reads this (protocol.RowCost)."""
        if exact:
            return self(n, masked) / self(1, masked)
        secs = self.seconds if masked else (self.plain_seconds or self.seconds)
        at = next((i for i, r in enumerate(self.rows) if r >= n), None)
        if at is not None:
            return secs[at] / secs[0]
        rows = self.rows
        slope = (secs[-1] - secs[-2]) / (rows[-1] - rows[-2]) if len(rows) > 1 else 0.0
        return (secs[-1] + slope * (n - rows[-1])) / secs[0]

    def describe(self) -> str:
        ratios = ", ".join(
            f"c({n})/c(1) {s / self.seconds[0]:.2f}"
            for n, s in zip(self.rows[1:], self.seconds[1:], strict=True)
        )
        line = f"{self.backend} pass, context {self.context}: c(1) {1e3 * self.seconds[0]:.1f} ms, {ratios}"
        if self.plain_seconds is not None:
            line += "; real rows only: " + ", ".join(
                f"c({n})/c(1) {s / self.plain_seconds[0]:.2f}"
                for n, s in zip(self.rows[1:], self.plain_seconds[1:], strict=True)
            )
        return line

    def save(self, path: Path) -> Path:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: Path) -> PassCost:
        try:
            raw = json.loads(Path(path).read_text())
            plain = raw.get("plain_seconds")
            curve = cls(
                tuple(int(r) for r in raw["rows"]),
                tuple(float(s) for s in raw["seconds"]),
                str(raw.get("backend", "?")),
                int(raw.get("context", 0)),
                tuple(float(s) for s in plain) if plain is not None else None,
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(
                f"pass_cost {path}: not a pass-cost curve ({exc}); write one with "
                "scripts/pass_cost.py --json FILE, or use pass_cost=measure"
            ) from None
        if (
            not curve.rows
            or curve.rows[0] != 1
            or len(curve.rows) != len(curve.seconds)
            or (curve.plain_seconds is not None and len(curve.plain_seconds) != len(curve.rows))
        ):
            raise UserError(
                f"pass_cost {path}: the curve must start at 1 row and give one time per row count"
            )
        return curve


@torch.inference_mode()
def measure(
    model,
    backend_name: str = "eager",
    rows: tuple[int, ...] = ROWS,
    context: int = 200,
    repeats: int = 10,
    backend=None,
    masked: bool = True,
    head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    masked_rows: int | None = None,
) -> PassCost:
    """Time one pass per row count (best of `repeats`, row counts interleaved) on `model` (an MTPModel), on
    `backend` if given (its slot 0 is overwritten; a compiled one keeps its compiled buckets), else a new
    one; each pass with `head` (default: the backend's LM head) over its real rows. `masked` False: passes
    of real rows only (both curves of the result are theirs). `masked_rows`: <mtp> passes timed up to that
    many rows only (those a compiled backend has graphs for); wider ones cost the real rows' time plus
    the widest timed one's premium."""
    from mtplm.decode.passes.backends import make_backend
    from mtplm.decode.protocol import Feed

    backend = backend or make_backend(backend_name, model, slots=1)
    context = min(context, getattr(model.hf.config, "max_position_embeddings", context) - max(rows) - 1)
    token = 5  # any ordinary token: the cost does not depend on which
    backend.run(0, [Feed([token] * context, context, 0, 0, False, None)], [0])
    feeds = {(n, False): Feed([token] * n, 1, n - 1, 0, False, None) for n in rows}  # 1 token + n-1 drafts
    timed = [n for n in rows if masked_rows is None or n <= masked_rows]
    if masked:
        feeds |= {
            (n, True): Feed([token] + [model.mask_id] * (n - 1), 1, 0, n - 1, False, None) for n in timed
        }
    head = head or backend.head
    best = dict.fromkeys(feeds, float("inf"))
    was_training = model.hf.training
    model.hf.eval()
    for round_ in range(repeats + 1):  # round 0 warms up
        for key, feed in feeds.items():
            began = time.perf_counter()
            hidden = backend.run(0, [feed], [context])
            head(hidden[0, : len(feed.tokens)])
            if round_:
                best[key] = min(best[key], time.perf_counter() - began)
    model.hf.train(was_training)
    for n in rows[len(timed) :] if masked else ():  # beyond the timed <mtp> passes: their premium
        best[n, True] = best[n, False] + best[timed[-1], True] - best[timed[-1], False]
    # a pass with more rows never costs less: the running maximum removes what noise made look cheaper
    curve = {
        kind: tuple(itertools.accumulate((best[n, kind] for n in rows), max))
        for kind in ((True, False) if masked else (False,))
    }
    return PassCost(tuple(rows), curve[masked], backend_name, context, curve[False])


def curve_for(spec: str, model) -> PassCost | None:
    """The curve a `pass_cost` setting names: '' none, 'measure' timed now (eager), else a JSON file."""
    if not spec:
        return None
    if spec == "measure":
        return measure(model)
    return PassCost.load(Path(spec))
