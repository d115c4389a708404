"""Decoding. The strategies, written against protocol.py (strategies.py, verified.py; their registry
modes.py; accept.py, sampling.py, windows.py, budget.py; their replay over records, replay.py), and by role:
run/ (the loop and the batch engine), drafts/ (draft sources), constraints/ (structured outputs), passes/
(the backends and their price) and fast/ (the compiled pass and mtplm's kernels)."""

from mtplm.decode.run.decoding import Decoding
from mtplm.decode.run.loop import generate, stop_ids, stream
from mtplm.decode.run.steps import Generation, Step

__all__ = ["Decoding", "Generation", "Step", "generate", "stop_ids", "stream"]
