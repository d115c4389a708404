"""The decoding loop: plain and never-accepting ConfAdapt equal HF greedy; cache bookkeeping; stop tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_mtp

from mtplm.config import DecodeConfig, Thresholds
from mtplm.decode.run.loop import generate, stream
from mtplm.decode.strategies import make_strategy


def _prompts(n: int, vocab: int):
    g = torch.Generator().manual_seed(7)
    return [
        torch.randint(0, vocab - 3, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def _hf_greedy(model, prompt, n):
    out = model.hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        do_sample=False,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("gated", [False, True])
def test_plain_and_never_accepting_confadapt_equal_hf_greedy(gated):
    model = tiny_mtp(seed=3, gated=gated)
    for prompt in _prompts(6, model.hf.config.vocab_size):
        expected = _hf_greedy(model, prompt, 20)
        plain = generate(model, prompt, DecodeConfig(mode="ntp", max_new_tokens=20))
        # tau = 1.0 is never reached by a softmax over > 1 token: every step emits exactly one token
        never = generate(model, prompt, DecodeConfig(mode="confadapt", k_max=6, tau=1.0, max_new_tokens=20))
        eos = model.hf.config.eos_token_id
        cut = expected.index(eos) + 1 if eos in expected else len(expected)
        assert plain.tokens == expected[:cut]
        assert never.tokens == expected[:cut]
        assert set(never.accepted) == {1}


@pytest.mark.parametrize(
    "mode,extra", [("confadapt", dict(k_max=5, tau=0.05)), ("static", dict(k=3)), ("ntp", {})]
)
def test_cache_holds_exactly_the_committed_tokens_after_every_step(mode, extra):
    model = tiny_mtp(seed=1)
    prompt = _prompts(1, model.hf.config.vocab_size)[0]
    cfg = DecodeConfig(mode=mode, max_new_tokens=30, **extra)
    emitted = 0
    for step in stream(
        model,
        prompt,
        DecodeConfig(max_new_tokens=30, ignore_eos=True),
        make_strategy(cfg, Thresholds(k_max=5)),
    ):
        assert step.cache_len == len(prompt) + emitted  # this step's tokens are fed next step
        emitted += len(step.tokens)
    assert emitted == 30


def test_low_threshold_emits_several_tokens_and_respects_the_budget():
    model = tiny_mtp(seed=2)
    prompt = _prompts(1, model.hf.config.vocab_size)[0]
    out = generate(model, prompt, DecodeConfig(mode="confadapt", k_max=4, tau=1e-6, max_new_tokens=10))
    assert len(out.tokens) == 10
    assert out.accepted[0] == 4 and out.forwards == 3


def test_stop_token_inside_a_block_ends_generation_there():
    model = tiny_mtp(seed=2)
    prompt = _prompts(1, model.hf.config.vocab_size)[0]
    free = generate(model, prompt, DecodeConfig(mode="static", k=4, max_new_tokens=12))
    stop_token = free.tokens[5]  # lies inside the second block
    first = free.tokens.index(stop_token)
    steps = list(
        stream(
            model, prompt, DecodeConfig(mode="static", k=4, max_new_tokens=12, stop_token_ids=(stop_token,))
        )
    )
    emitted = [t for s in steps for t in s.tokens]
    assert emitted == free.tokens[: first + 1]
    assert steps[-1].stopped


def test_sampling_is_reproducible_under_a_seed_and_differs_across_seeds():
    model = tiny_mtp(seed=4)
    prompt = [1, 2, 3]
    runs = [
        generate(model, prompt, DecodeConfig(mode="ntp", temperature=1.0, max_new_tokens=25, seed=s)).tokens
        for s in (0, 0, 1)
    ]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_backoff_shrinks_the_block_after_single_token_steps():
    model = tiny_mtp(seed=5)
    cfg = DecodeConfig(
        mode="confadapt", k_max=8, tau=1.0, backoff=True, backoff_patience=2, max_new_tokens=12
    )
    strategy = make_strategy(cfg, Thresholds())
    offered = [
        s.offered
        for s in stream(model, [1, 2, 3], DecodeConfig(max_new_tokens=12, ignore_eos=True), strategy)
    ]
    assert offered[:6] == [8, 8, 4, 4, 2, 2]  # the floor holds; the last block is cut by the budget


def test_pristine_base_gives_the_same_plain_tokens_and_restores_the_adapters():
    model = tiny_mtp(seed=6, gated=True)
    prompt, cfg = [4, 5, 6], DecodeConfig(mode="ntp", max_new_tokens=15)
    wrapped = generate(model, prompt, cfg).tokens
    with model.pristine():
        assert not any("lora" in name for name, _ in model.hf.named_parameters())
        assert generate(model, prompt, cfg).tokens == wrapped
    masked = torch.tensor([[4, 5, 6, model.mask_id, model.mask_id]])
    with torch.no_grad():
        with_adapters = model.logits(masked)
        with model.adapters_disabled():
            without = model.logits(masked)
    assert not torch.allclose(
        with_adapters[0, -2:], without[0, -2:]
    )  # the adapters are back and act on masks
