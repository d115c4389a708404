"""Load policies: a fixed batch-size schedule, and the measured one that keeps whichever pass pays."""

from __future__ import annotations

from mtplm.decode.run.policy import KByBatch, Measured


def test_schedule_takes_the_largest_entry_not_above_the_batch():
    policy = KByBatch({1: 8, 4: 4, 8: 1})
    assert [policy.cap(b) for b in (1, 3, 4, 7, 8, 30)] == [8, 8, 4, 4, 1, 1]
    assert KByBatch({4: 2}).cap(2) is None


def _run(policy: Measured, batch: int, passes: int, cost: dict[bool, tuple[float, float]]) -> list[bool]:
    """Drive the policy with fixed (seconds, tokens per sequence) for uncapped / capped passes."""
    choices = []
    for _ in range(passes):
        capped = policy.cap(batch) is not None
        seconds, tokens = cost[capped]
        policy.observe(batch, capped, seconds, tokens)
        choices.append(capped)
    return choices


def test_measured_policy_turns_multi_token_passes_off_where_they_lose():
    # batch 8 on this CPU: an <mtp> pass costs 3.19x for 1.25 tokens -> plain passes win
    choices = _run(Measured(explore_every=16), 8, 64, {False: (0.178, 1.25), True: (0.056, 1.0)})
    assert choices[:2] == [False, True]  # both measured first
    assert sum(choices[2:]) >= 58  # then plain, but for the exploring passes
    assert not all(choices[2:])


def test_measured_policy_keeps_them_where_they_pay_and_follows_a_change():
    policy = Measured(explore_every=8)
    # alone on memory-bound hardware: 1.2x the time for 2.5 tokens -> multi-token passes win
    cheap = {False: (0.050, 2.5), True: (0.042, 1.0)}
    assert sum(_run(policy, 1, 40, cheap)[2:]) <= 6
    # the buckets are separate: a loaded batch learns on its own
    costly = {False: (0.178, 1.1), True: (0.056, 1.0)}
    assert sum(_run(policy, 8, 40, costly)[2:]) >= 30
    # the text gets harder at batch 1 (drafts rejected): exploring notices and switches
    harder = {False: (0.050, 1.05), True: (0.042, 1.0)}
    late = _run(policy, 1, 120, harder)[-40:]
    assert sum(late) >= 30
