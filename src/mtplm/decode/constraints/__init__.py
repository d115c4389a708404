"""Structured outputs: a grammar (JSON schema, regex, choice, CFG: spec.py, args.py) compiled to token masks
(constraint.py), drafts the grammar proposes or prunes (drafts.py), and the hook that puts it on a
sequence's passes in every mode (hook.py)."""
