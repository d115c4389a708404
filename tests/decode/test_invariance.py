"""Row invariance of the compiled pass in bf16: a row's hidden state and logits in a k-row pass are bitwise
what the 1-row pass gives it (the 1-row bucket runs the whole pass as one graph, the others a graph per
layer), so lossless verified decoding gives plain greedy decoding's exact tokens in bf16 too."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from mtplm.config import DecodeConfig, Thresholds, parse_mode
from mtplm.decode.fast import StaticBackend, fewrow, forward
from mtplm.decode.protocol import Feed, PassLogits, Plan
from mtplm.decode.run.loop import generate, stream
from mtplm.decode.strategies import make_strategy
from mtplm.decode.verified import Verified, in_place
from mtplm.model import MTPModel

VOCAB = 64


def odd_bf16_model(
    seed: int = 0, gated: bool = False, head_scale: float = 1.0, head_dim: int = 8
) -> MTPModel:
    """A random Llama of odd shapes (hidden 48, 6 query heads over 2 KV heads, MLP 88: off every kernel
    block) in bf16; `head_scale` < 1 shrinks the LM head so logits sit near ties. Heads of 8 dimensions
    attend through torch's products, of 64 through mtplm's attention kernel (where it loads)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=88,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=512,
        eos_token_id=VOCAB - 2,
        pad_token_id=VOCAB - 1,
    )
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(head_scale)
    model = MTPModel(hf, tiny_tokenizer(), None)
    model.add_mask_token(k_max=8, base_identity={"name": "odd-llama", "seed": seed})
    if gated:
        model.attach_gated_lora(rank=4, alpha=8.0)
        with torch.no_grad():  # non-zero adapters, so <mtp> rows differ from plain ones
            for name, p in model.hf.named_parameters():
                if ".lora_b" in name:
                    p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
        model.adapters_to(torch.bfloat16)
    model.hf.to(torch.bfloat16)
    return model


def feed(tokens: list[int], pending: int | None = None) -> Feed:
    pending = len(tokens) if pending is None else pending
    return Feed(tokens, pending, 0, 0, False, None)


def row_zero(backend: StaticBackend, tokens: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row 0's hidden state and logits of a pass feeding `tokens` behind `length` cached positions."""
    hidden = backend.run(0, [feed(tokens)], [length])[0, :1].clone()
    return hidden, backend.head(hidden)


@pytest.mark.parametrize("head_dim", [8, 64])
@pytest.mark.parametrize("gated", [False, True])
def test_a_rows_result_is_the_same_bitwise_whatever_rows_share_its_pass(gated, head_dim):
    model = odd_bf16_model(seed=3, gated=gated, head_dim=head_dim)
    backend = StaticBackend(model, 1, capacity=64, compile=True)
    prompt = [(7 * i) % (VOCAB - 2) for i in range(37)]
    with torch.inference_mode():
        backend.run(0, [feed(prompt)], [0])
        for length in (37, 29):  # two cache lengths, the second behind rows the first wrote
            alone = row_zero(backend, [11], length)
            for rows in range(2, 10):  # fed unpadded on a CPU: odd counts too
                others = [(11 + 5 * r) % (VOCAB - 2) for r in range(1, rows)]
                if gated and rows % 2:  # <mtp> rows behind it: the adapters' graphs
                    others[-1] = model.mask_id
                shared = row_zero(backend, [11, *others], length)
                assert torch.equal(shared[0], alone[0]), f"hidden, {rows} rows behind {length}"
                assert torch.equal(shared[1], alone[1]), f"logits, {rows} rows behind {length}"
    assert any(bucket[1] == 1 for bucket in backend.compiled_buckets) and backend.whole_rows >= 1
    # where no op pads by rows (head dim 64: mtplm's attention kernel), 3, 5, 6, 7 and 9 rows ran as they are,
    # through the graphs of 2 rows and more: none compiled for them
    unpadded = forward.rows_unpadded(head_dim, torch.bfloat16)
    assert backend.exact_rows(1, 3) == unpadded and not backend.exact_rows(1, 1)
    assert not unpadded or {graph[1] for graph in backend.compiled_buckets} == {1, "2-32"}


@pytest.mark.parametrize("drafts", [0, 3])
def test_a_decode_feed_wider_than_the_buckets_comes_out_as_one_row_passes_give_it(drafts):
    """A decode feed of 45 pending rows (a long forced run), drafts behind it, runs in row buckets
    (chunked.run_split), not on the wide path (flash attention, which rounds by the rows fed): every row is
    bitwise what 1-row passes give it, as in a mode that held some of those tokens as drafts."""
    model = odd_bf16_model(seed=7, head_dim=64)
    pending, past = 45, 4
    tokens = [(5 * i + 3) % (VOCAB - 2) for i in range(pending + drafts)]
    wide = StaticBackend(model, 1, capacity=128, compile=True)
    alone = StaticBackend(model, 1, capacity=128, compile=True)
    with torch.inference_mode():
        for backend in (wide, alone):
            backend.run(0, [feed(tokens[-past:])], [0])  # a cached prefix first
        got = wide.run(0, [Feed(tokens, pending, drafts, 0, False, None, prompt=0)], [past])[0]
        for row in range(pending + drafts):  # pending tokens and a chain of drafts: causal alike
            one = alone.run(0, [feed(tokens[row : row + 1])], [past + row])[0, 0]
            assert torch.equal(got[row], one), f"row {row}"
    for mine, theirs in zip(wide.keys + wide.values, alone.keys + alone.values, strict=True):
        assert torch.equal(mine[0, :, : past + pending + drafts], theirs[0, :, : past + pending + drafts])


def test_verified_lookup_greedy_is_plain_greedy_in_bf16():
    """Near-tie logits (a shrunk LM head), prompts that repeat so lookup drafts: every pass it verifies with
    k rows must pick what the 1-row plain pass picks. Prompts of 18 tokens (a compiled bucket) and of 43
    (a wide pass: flash attention, whose rounding depends on the rows fed, so no drafts may ride along)."""
    model = odd_bf16_model(seed=5, head_scale=0.05)
    backend = StaticBackend(model, 1, capacity=256, compile=True)
    lookup = parse_mode("verified:lookup")
    drafted = 0
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        phrase = torch.randint(0, VOCAB - 2, (5,), generator=g).tolist()
        prompt = phrase * (3 if seed % 2 else 8) + torch.randint(0, VOCAB - 2, (3,), generator=g).tolist()
        plain = generate(model, prompt, DecodeConfig(mode="ntp", max_new_tokens=40), backend=backend)
        cfg = DecodeConfig(**{**lookup.__dict__, "max_new_tokens": 40})
        fast = generate(model, prompt, cfg, backend=backend)
        assert fast.tokens == plain.tokens, f"prompt {seed}"
        drafted += sum(d for d, _ in fast.drafts)
    assert drafted > 0  # lookup did draft, so k-row passes were verified


def test_verified_knows_the_widest_decode_pass():
    """verified.py keeps drafts off a prompt pass wider than this (a wide pass rounds by its rows)."""
    from mtplm.decode.fast.backend import ROW_BUCKETS
    from mtplm.decode.verified import DECODE_ROWS

    assert DECODE_ROWS == ROW_BUCKETS[-1]


@pytest.mark.parametrize("mode", ["verified:tree", "verified:quadratic@4", "verified:quadratic+lookup@4"])
def test_a_wide_prompt_pass_feeds_the_prompt_alone(mode):
    """The first pass of a long prompt carries no drafts and no <mtp> block in any verified strategy: they
    would widen the compiled backend's wide (prompt) pass, whose rounding depends on its rows, and part the
    prompt's bf16 KV from plain decoding's (verified:tree once did: 6 of 10 prompts parted, the first at
    its first token). A short prompt's first pass, a decode pass, keeps its block."""
    from mtplm.decode.verified import DECODE_ROWS

    strategy = make_strategy(parse_mode(mode), Thresholds(k_max=4))
    long = strategy.plan(list(range(DECODE_ROWS + 5)), 64, None)
    assert (long.drafts, long.slots) == ((), 0)
    assert strategy.plan([1, 2, 3], 64, None).slots > 0


def test_a_path_off_the_chain_is_kept_only_where_its_rows_sit_in_place():
    """Chain (7, 8) and a copied branch (9, 10, 11) off the root: a path along the branch keeps nothing,
    takes the branch's first token (confirmed by row 0, in place) and carries the rest to the next pass."""
    strategy = Verified(parse_mode("verified:quadratic+lookup@4"))
    plan = Plan(4, (7, 8, 9, 10, 11), 3, True, parents=(-1, 0, -1, 2, 3), anchors=(-1, 0, 1), drafted=2)
    feed = Feed.of(plan, [5], 3, lambda: VOCAB - 3)
    target = [9, 1, 2, 10, 11, 12]  # row 0 (the last committed token) then nodes 0 .. 4
    logits = torch.nn.functional.one_hot(torch.tensor(target), VOCAB).float()
    outcome = strategy.choose(plan, PassLogits(lambda h: h, logits, feed, logits), torch.Generator())
    assert (outcome.accepted, outcome.new, outcome.rows, outcome.drafts) == (0, (9,), None, (10, 11))
    assert strategy.draft(outcome, torch.zeros(3, VOCAB), 3, torch.Generator()).drafts == (10, 11)
    on_chain = [7, 8, 3, 0, 0, 0]  # the chain kept whole: the bonus token, nothing carried
    logits = torch.nn.functional.one_hot(torch.tensor(on_chain), VOCAB).float()
    outcome = strategy.choose(plan, PassLogits(lambda h: h, logits, feed, logits), torch.Generator())
    assert (outcome.accepted, outcome.new, outcome.drafts) == (2, (3,), ())
    assert in_place([0, 1, 4]) == 2 and in_place([2, 3]) == 0 and in_place([]) == 0


def test_verified_quadratic_lookup_greedy_is_plain_greedy_in_bf16():
    """<mtp> rows and copied drafts that leave the mask chain (a tree whose second branch sits after the
    chain's rows), near-tie logits: greedy tokens must be plain's, on the uncompiled and compiled pass.
    (This model's off-chain paths happened to round alike before the fix too: it guards the mode, while
    the cut itself is pinned by the test above.)"""
    model = odd_bf16_model(seed=5, gated=True, head_scale=0.05)
    mode = parse_mode("verified:quadratic+lookup@4")
    off_chain = 0
    for compiled in (False, True):
        backend = StaticBackend(model, 1, capacity=256, compile=compiled)
        for seed in range(4):
            g = torch.Generator().manual_seed(seed)
            phrase = torch.randint(0, VOCAB - 3, (6,), generator=g).tolist()
            prompt = phrase * 3 + torch.randint(0, VOCAB - 3, (4,), generator=g).tolist()
            plain = generate(model, prompt, DecodeConfig(mode="ntp", max_new_tokens=48), backend=backend)
            cfg = DecodeConfig(**{**mode.__dict__, "max_new_tokens": 48})
            strategy = make_strategy(cfg, model.meta.decode_thresholds())
            steps = list(stream(model, prompt, cfg, strategy, backend))
            fast = [t for step in steps for t in step.tokens]
            assert fast == plain.tokens, f"prompt {seed}, compiled {compiled}"
            off_chain += sum(1 for step in steps if step.drafted > step.accepted)
    assert off_chain > 0  # drafts were rejected: trees were verified


@pytest.mark.parametrize("path", ["probed", "forced", "kernel"])
@pytest.mark.parametrize("kv_len", [100, 700, 2000])
def test_attention_gives_a_row_the_same_sums_whatever_rows_share_its_pass(kv_len, path, monkeypatch):
    """forward.attend at SmolLM2's attention shapes (9 query heads over 3 KV heads, d 64) and long key
    lengths, where BLAS picks its kernel by the product's shape: row 0's output alone and as the first of 2,
    5, 8 or 32 rows (causal among them), bitwise, in float32 (no rounding to bf16 hides a difference).
    torch's products ("probed": padded where this machine's probe asks; "forced": padded on any machine)
    over one key count: the padding's claim (fails on MKL over an AMD EPYC without it). mtplm's kernel
    ("kernel") also over the key count each pass has (kv_len + rows): MKL over an Intel Xeon rounds by key
    count at 700 and 2000 keys, the kernel must not."""
    if path == "kernel" and not fewrow.load():
        pytest.skip("mtplm's kernel does not load here (needs a C++ compiler and avx512_bf16)")
    monkeypatch.setattr(forward, "_attention_kernel", path == "kernel")
    if path == "forced":
        monkeypatch.setattr(forward, "_attention_rows", forward.ATTENTION_ROWS)
    torch.manual_seed(kv_len)
    keys, values = torch.randn(2, 3, kv_len + 40, 64), torch.randn(2, 3, kv_len + 40, 64)
    query, slots = torch.randn(1, 32, 9, 64), torch.tensor([1])

    def row_zero(rows: int) -> torch.Tensor:
        t = kv_len + (rows if path == "kernel" else 32)
        mask = torch.full((1, 1, 1, rows, t), torch.finfo(torch.float32).min)
        mask[..., : kv_len + rows] = 0.0
        mask[..., kv_len : kv_len + rows] = torch.full((rows, rows), torch.finfo(torch.float32).min).triu(1)
        return forward.attend(query[:, :rows], keys, values, slots, t, mask, 0.125)[:, :1]

    alone = row_zero(1)
    for rows in (2, 5, 8, 32):
        assert torch.equal(row_zero(rows), alone), (
            f"{rows} rows, {path}, {forward.attention_rows()}-row padding"
        )
