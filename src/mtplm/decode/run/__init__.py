"""The decode loop and the batch engine: one pass for one or many sequences (loop.run_pass), a sequence
between passes and each pass's decision (decoding.py: its committed record, sequence.py, and the hooks a
request adds: logprobs.py, penalties.py, heads_hook.py, constraints/hook.py), the engine that batches
requests (engine.py, its load policy policy.py) and the warm-up that compiles and prices the passes
before anything is timed (warm.py)."""
