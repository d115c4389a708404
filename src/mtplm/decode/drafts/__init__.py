"""Draft sources for verified decoding: the proposer protocol and its registry (proposers.py) and the
n-gram lookup over the text so far (lookup.py). The <mtp> slots' and the heads' drafts come from the pass
itself (the strategies, decode/verified.py)."""
