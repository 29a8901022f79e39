"""The bootstrap interval between two setups' repeated runs: it finds a real shift, finds none where
there is none, and does not mistake how runs differ from one another for a difference of setups."""

from __future__ import annotations

import random

import pytest

from kvmesh.loadgen.run_comparison import differences


def _run(rng: random.Random, requests: int = 300, offset_s: float = 0.0, cached: float = 0.5) -> list[dict]:
    rows = []
    for _ in range(requests):
        prompt = rng.randint(100, 4000)
        rows.append(
            {
                "prompt_tokens": prompt,
                "cached_tokens": round(prompt * cached),
                "ttft_s": offset_s + rng.lognormvariate(-2.5, 0.8),
                "error": None,
            }
        )
    return rows


def _by_name(a: list[list[dict]], b: list[list[dict]]) -> dict:
    return {difference.name: difference for difference in differences(a, b, draws=500)}


def test_setups_drawn_alike_are_not_told_apart():
    rng = random.Random(1)
    found = _by_name([_run(rng) for _ in range(3)], [_run(rng) for _ in range(3)])
    for difference in found.values():
        assert difference.low <= difference.value <= difference.high
        assert not difference.tells_apart, difference


def test_a_shift_in_every_run_is_found_and_sized():
    rng = random.Random(2)
    slower = [_run(rng, offset_s=0.2, cached=0.3) for _ in range(3)]
    found = _by_name(slower, [_run(rng) for _ in range(3)])
    p50 = found["TTFT p50 ms"]
    assert p50.tells_apart and p50.low <= 200 <= p50.high + 20  # the lognormal's own median moves too
    share = found["cached share"]
    assert share.tells_apart  # every request cached 0.3 of its prompt against 0.5
    assert share.low == pytest.approx(-0.2, abs=1e-3) and share.high == pytest.approx(-0.2, abs=1e-3)
    assert str(share).startswith("cached share -0.2")


def test_runs_that_differ_from_each_other_do_not_make_a_difference_of_setups():
    # The same setup: one run of three fell on a slow machine for a, two of three for b. Pooled, b
    # looks 0.13 s slower; resampling requests alone would call that certain, the runs cannot.
    rng = random.Random(3)
    a = [_run(rng), _run(rng), _run(rng, offset_s=0.4)]
    b = [_run(rng), _run(rng, offset_s=0.4), _run(rng, offset_s=0.4)]
    p50 = _by_name(a, b)["TTFT p50 ms"]
    assert p50.value < -100
    assert not p50.tells_apart, p50


def test_failed_requests_are_left_out_and_a_request_without_a_token_counts_its_cache():
    rng = random.Random(4)
    run = _run(rng, requests=50)
    failed = {"prompt_tokens": 10_000, "cached_tokens": 0, "ttft_s": None, "error": "timeout"}
    silent = {"prompt_tokens": 1000, "cached_tokens": 1000, "ttft_s": None, "error": None}
    found = _by_name([[*run, failed, silent]], [run])
    share = found["cached share"]
    prompt = sum(row["prompt_tokens"] for row in run)
    cached = sum(row["cached_tokens"] for row in run)
    assert share.value == pytest.approx((cached + 1000) / (prompt + 1000) - cached / prompt)
    assert found["TTFT p50 ms"].value == 0


def test_a_setup_without_runs_or_a_run_without_answers_is_refused():
    rng = random.Random(5)
    with pytest.raises(ValueError, match="at least one run"):
        differences([], [_run(rng)])
    with pytest.raises(ValueError, match="no completed request"):
        differences([[{"prompt_tokens": 1, "cached_tokens": 0, "ttft_s": None, "error": "x"}]], [_run(rng)])
    with pytest.raises(ValueError, match="draws"):
        differences([_run(rng)], [_run(rng)], draws=0)
