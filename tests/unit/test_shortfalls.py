"""The verdict of issue 45's first item (kvmesh.replay.report.shortfalls): the default against the
best of its rivals in every column, compared as the reports print the figures."""

from __future__ import annotations

import pytest

from kvmesh.replay.report import closest_margin, shortfalls

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
