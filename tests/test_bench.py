"""lapheads.bench: interleaved timing, ratios paired round by round, and their distribution-free interval."""

from __future__ import annotations

import math
from types import SimpleNamespace

from lapheads import bench
from lapheads.bench import median_interval


def test_the_median_interval_is_the_order_statistics_of_binomial_coverage():
    from scipy.stats import binom

    median, low, high = median_interval([float(x) for x in range(20)])
    assert (median, low, high) == (9.5, 5.0, 14.0)  # [x_(6), x_(15)]: coverage 1 - 2 P(Bin(20, 1/2) <= 5) >= 0.95
    assert 1 - 2 * binom.cdf(5, 20, 0.5) >= 0.95 > 1 - 2 * binom.cdf(6, 20, 0.5)
    assert math.isnan(median_interval([1.0, 2.0, 3.0, 4.0, 5.0])[1])  # 5 values: no 95% interval exists


def test_interleaved_ratios_divide_round_by_round_so_a_slow_round_cancels(monkeypatch):
    clock = iter([0.0, 1.0, 1.0, 3.0] + [3.0, 13.0, 13.0, 33.0] + [33.0, 34.0, 34.0, 36.0] * 6)
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(bench.random.Random, "shuffle", lambda self, order: None)  # a fixed order: base, then twice
    out = bench.interleaved_ratios({"base": lambda: None, "twice": lambda: None}, "base", 8, warmup=0)
    assert out["twice"]["ratio"] == 2.0 and out["twice"]["ratio_low"] == out["twice"]["ratio_high"] == 2.0
    assert out["base"]["ratio"] == 1.0 and out["twice"]["seconds"] == 2.0  # the slow round (10 s / 20 s) divides out
