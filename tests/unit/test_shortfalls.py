"""The verdict of issue 45's first item (kvmesh.replay.report.shortfalls): the default against the
best of its rivals in every column, compared as the reports print the figures."""

from __future__ import annotations

import pytest

from kvmesh.replay.report import closest_margin, pooled_margins, shortfalls

PLAIN_KV = (0.551, 91.0, 494.0)
CACHE_AWARE = (0.591, 102.0, 3298.0)


def test_a_candidate_that_matches_the_best_of_each_column_wins_them_all():
    # the most reuse of either rival, the shortest p50 and p99 of either: ties as printed count
    assert shortfalls((0.5912, 91.4, 493.6), [PLAIN_KV, CACHE_AWARE]) == []
    assert shortfalls((0.603, 89.0, 300.0), [PLAIN_KV, CACHE_AWARE]) == []


def test_each_column_falls_short_on_its_own_rival():
    # chat's default on 2026-12-01: more reuse than both, the shortest median, plain kv's tail shorter
    assert shortfalls((0.603, 89.0, 522.0), [PLAIN_KV, CACHE_AWARE]) == ["p99"]
    # less reuse than cache-aware (a point printed below it), the median of neither
    assert shortfalls((0.5904, 92.0, 494.0), [PLAIN_KV, CACHE_AWARE]) == ["reuse", "p50"]
    assert shortfalls((0.5, 120.0, 600.0), [PLAIN_KV, CACHE_AWARE]) == ["reuse", "p50", "p99"]


def test_no_rival_is_an_error():
    with pytest.raises(ValueError, match="no rival"):
        shortfalls(PLAIN_KV, [])


def test_the_closest_margin_names_the_nearest_column_at_full_precision():
    # a median 0.9 ms behind plain kv's (printed 81 ms against 80): behind by 1.2%
    column, margin = closest_margin((0.902, 80.75, 325.0), [(0.900, 79.82, 406.0), (0.799, 98.8, 34636.0)])
    assert column == "p50"
    assert margin == pytest.approx((79.82 - 80.75) / 79.82)
    # ahead everywhere: the smallest lead is named, and it is positive
    column, margin = closest_margin((0.603, 89.0, 490.0), [PLAIN_KV, CACHE_AWARE])
    assert (column, margin) == ("p99", pytest.approx((494.0 - 490.0) / 494.0))
    # reuse is the nearest column when it leads by less than either time
    column, margin = closest_margin((0.5915, 80.0, 300.0), [PLAIN_KV, CACHE_AWARE])
    assert column == "reuse" and margin == pytest.approx((0.5915 - 0.591) / 0.591)


def test_the_closest_margin_needs_a_rival():
    with pytest.raises(ValueError, match="no rival"):
        closest_margin(PLAIN_KV, [])


def test_pooled_margins_read_many_traces_per_column():
    # agent loops of two draws: more reuse and a shorter tail on both; the median 0.5 ms ahead on one
    # and 0.5 ms behind on the other
    rivals = [(0.900, 80.0, 400.0), (0.800, 95.0, 30000.0)]
    traces = [((0.905, 79.5, 300.0), rivals), ((0.903, 80.5, 320.0), rivals)]
    reuse, p50, p99 = pooled_margins(traces, resamples=2000)
    assert reuse.column == "reuse" and reuse.mean == pytest.approx((0.005 + 0.003) / 0.9 / 2)
    assert (reuse.ahead, reuse.behind) == (2, 0) and reuse.low > 0  # ahead on every trace: 0 left out
    assert p50.mean == pytest.approx(0.0) and (p50.ahead, p50.behind) == (1, 1)
    assert p50.low < 0 < p50.high  # these traces cannot tell the medians apart
    assert p99.mean == pytest.approx((100 + 80) / 400 / 2) and p99.low == pytest.approx(0.2)
    assert "ahead on 2, behind on 0" in str(p99)


def test_pooled_margins_are_the_same_each_time_and_need_a_trace():
    traces = [((0.5, 90.0, 500.0), [(0.49 + i / 100, 89.0 + i, 480.0 + i)]) for i in range(5)]
    assert pooled_margins(traces) == pooled_margins(traces)
    wide, narrow = pooled_margins(traces)[1], pooled_margins(traces, level=0.5)[1]
    assert wide.low < narrow.low <= narrow.mean <= narrow.high < wide.high and narrow.level == 0.5
    with pytest.raises(ValueError, match="no trace"):
        pooled_margins([])
