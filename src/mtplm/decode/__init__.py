"""Decoding: the loop (loop.py) over a backend (backends.py) that runs the fed rows, strategies that plan and
choose (strategies.py, verified.py over protocol.py), sampling and confidence measures, the batch engine."""

from mtplm.decode.decoding import Decoding
from mtplm.decode.loop import generate, stop_ids, stream
from mtplm.decode.steps import Generation, Step

__all__ = ["Decoding", "Generation", "Step", "generate", "stop_ids", "stream"]
