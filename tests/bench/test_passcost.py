"""The pass-cost curve: <mtp> passes and real-row passes, priced apart, and what a replay's speedup reads
from it."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_mtp

from mtplm.decode.passes.passcost import PassCost, measure
from mtplm.errors import UserError
from mtplm.train.predict import Tally


def test_measure_times_both_kinds_of_pass_and_round_trips(tmp_path):
    curve = measure(tiny_mtp(gated=True), "eager", rows=(1, 2, 4), context=16, repeats=2)
    assert curve.plain_seconds is not None and len(curve.plain_seconds) == len(curve.rows) == 3
    for times in (curve.seconds, curve.plain_seconds):
        assert all(a <= b for a, b in zip(times, times[1:], strict=False))  # more rows never cost less
    assert "real rows only" in curve.describe()
    assert PassCost.load(curve.save(tmp_path / "curve.json")) == curve


def test_real_row_passes_are_priced_on_their_own_curve():
    curve = PassCost((1, 8), (0.010, 0.020), "x", 200, (0.010, 0.011))
    assert curve(8) == pytest.approx(0.020) and curve(8, masked=False) == pytest.approx(0.011)
    assert PassCost((1, 8), (0.010, 0.020))(8, masked=False) == pytest.approx(
        0.020
    )  # unmeasured: the upper bound
    copied, masked = Tally(), Tally()
    for _ in range(10):
        copied.count(8, 2, masked=False)
        masked.count(8, 2)
    assert copied.speedup(curve) == pytest.approx(2 * 0.010 / 0.011)
    assert masked.speedup(curve) == pytest.approx(2 * 0.010 / 0.020)


def test_a_curve_file_with_mismatched_real_row_times_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": [1, 2], "seconds": [0.01, 0.02], "plain_seconds": [0.01]}))
    with pytest.raises(UserError, match="one time per row count"):
        PassCost.load(bad)
