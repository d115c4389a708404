"""Copied (lookup) and greedy draft chains are cut at the first token the grammar rejects before they are fed,
and a lookup chain is extended by the tokens the grammar forces after it (constraints/drafts.py pruned):
every fed chain is grammar-valid, some were cut, some extended, and the tokens stay constrained plain's."""

from __future__ import annotations

import torch

from grammar_model import json_mtp
from mtplm.config import DecodeConfig, Thresholds
from mtplm.decode.constraints import constraint as C
from mtplm.decode.passes.backends import EagerBackend, describe
from mtplm.decode.run.decoding import Decoding
from mtplm.decode.run.loop import generate, stop_ids
from mtplm.decode.strategies import make_strategy

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["admin", "user"]}},
        "count": {"type": "integer", "maximum": 99},
    },
    "required": ["name", "tags", "count"],
}
# the prompt repeats JSON the grammar does not allow here, so lookup copies drafts it rejects
PROMPT = '{"name": "Ada", "age": 36, "tags": ["admin", "user"]} {"ok": true, "count": 12} {'


def _fed_chains(model, cfg: DecodeConfig) -> tuple[list[int], int, int, int]:
    """Decode under SCHEMA, checking each fed chain: (tokens, chains fed, cut, extended)."""
    ids = model.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    grammar = C.compile(C.json_schema(SCHEMA), model.tokenizer, stop_ids(model))
    backend = EagerBackend(model, slots=1)
    strategy = make_strategy(cfg, Thresholds())
    sequence = Decoding(
        describe(model, backend),
        ids,
        strategy,
        cfg,
        grammar.start(),
    )
    planned, original = [], strategy.plan

    def plan(*args, **kwargs):
        planned.append(original(*args, **kwargs))
        return planned[-1]

    strategy.plan = plan  # see what the strategy planned beside what was fed
    tokens, fed, cut, extended = [], 0, 0, 0
    kv = backend.kv(0)
    with torch.inference_mode():
        while not sequence.done:
            feed = sequence.feed()
            drafts = sequence.plan.drafts
            assert sequence.constraint.accepts(drafts) == len(drafts)  # every fed draft is grammar-valid
            fed += bool(drafts)
            cut += drafts[: len(planned[-1].drafts)] != planned[-1].drafts
            extended += len(drafts) > len(planned[-1].drafts)
            hidden = backend.run(0, [feed], [sequence.past])[0, : len(feed.tokens)]
            tokens += sequence.advance(hidden, kv, model.head(hidden[feed.pending - 1 :])).tokens
    return tokens, fed, cut, extended


def test_lookup_drafts_the_grammar_rejects_are_not_fed_and_tokens_stay_plain():
    model = json_mtp(seed=3)
    cfg = DecodeConfig(mode="verified", drafting="lookup", max_new_tokens=60)
    tokens, fed, cut, extended = _fed_chains(model, cfg)
    assert fed and cut and extended  # lookup proposed chains the grammar cut; forced tokens extended some
    plain_cfg = DecodeConfig(mode="ntp", max_new_tokens=60)
    grammar = C.compile(C.json_schema(SCHEMA), model.tokenizer, stop_ids(model))
    ids = model.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    plain = generate(model, ids, plain_cfg, constraint=grammar.start())
    assert tokens == plain.tokens
