"""The router learns a worker's step-time model from the steps it runs."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvmesh.common.core.timing import TimingModel, scaled
from kvmesh.common.core.timing_fit import TimingFit, _features
from kvmesh.router.scheduler import Candidate, make_cost_model

CAPACITY = 16384 * 64


def steps(truth: TimingModel, count: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(count):
        tokens = rng.choice([0, rng.randrange(1, 8192)])
        decoding = tokens == 0 or rng.random() < 0.7
        context = rng.randrange(0, CAPACITY // 2)
        yield tokens, context, decoding, truth.step_ms(tokens, context, CAPACITY, decoding) * rng.uniform(0.97, 1.03)


def test_without_steps_the_fit_is_its_prior():
    prior = scaled(TimingModel(), 2.0)
    assert TimingFit(prior).model() == prior


@pytest.mark.parametrize("prior_scale", [0.5, 2.0])
def test_a_prior_wrong_by_2x_converges_to_the_engines_model(prior_scale):
    truth = TimingModel()
    fit = TimingFit(scaled(truth, prior_scale))
    for tokens, context, decoding, ms in steps(truth, 2000):
        fit.observe(tokens, context, CAPACITY, decoding, ms)
    model = fit.model()
    for tokens in (256, 2048, 8192):
        assert model.prefill_ms(tokens) == pytest.approx(truth.prefill_ms(tokens), rel=0.05)
    for share in (0.1, 0.4):
        context = int(CAPACITY * share)
        assert model.decode_ms(context, CAPACITY, True) == pytest.approx(
            truth.decode_ms(context, CAPACITY, True), rel=0.1
        )


def test_steps_that_seem_faster_when_longer_never_fit_a_negative_or_falling_model():
    # What vLLM on a busy CPU once measured: noisy short prefills whose unconstrained fit falls with
    # the prompt length and is negative at 1,000 tokens (these constants are that fit).
    seeming = TimingModel(prefill_a=-1.07e-4, prefill_b=-0.149, prefill_c=206.8, decode_a=-30.0, decode_b=20.0)
    rng = random.Random(3)
    fit = TimingFit(TimingModel())
    for _ in range(500):
        tokens = rng.randrange(1, 300)
        context = rng.randrange(0, CAPACITY)
        ms = seeming.prefill_ms(tokens) + seeming.decode_ms(context, CAPACITY, True)
        fit.observe(tokens, context, CAPACITY, True, ms * rng.uniform(0.8, 1.2))
    model = fit.model()
    assert model != TimingModel()  # the steps moved it
    prefill = [model.prefill_ms(tokens) for tokens in (1, 100, 300, 1000, 8000, 32000)]
    assert all(ms >= 0 for ms in prefill) and prefill == sorted(prefill)
    decode = [model.decode_ms(int(CAPACITY * share), CAPACITY, True) for share in (0, 0.25, 0.5, 0.75, 1)]
    assert decode == sorted(decode)


def test_forgetting_follows_an_engine_that_slows_down():
    fit = TimingFit(TimingModel())
    for tokens, context, decoding, ms in steps(TimingModel(), 2000):
        fit.observe(tokens, context, CAPACITY, decoding, ms)
    slower = scaled(TimingModel(), 2.0)
    for tokens, context, decoding, ms in steps(slower, 6000, seed=1):
        fit.observe(tokens, context, CAPACITY, decoding, ms)
    assert fit.model().prefill_ms(4096) == pytest.approx(slower.prefill_ms(4096), rel=0.1)


def test_workers_of_different_speeds_get_different_costs():
    cost = make_cost_model("ttft", 16, 8192, 16384)
    fast, slow = (1, 0), (2, 0)
    cost.set_timing(slow, scaled(TimingModel(), 2.0))
    same_load = [Candidate(worker, 4000, 100) for worker in (fast, slow)]
    fast_cost, slow_cost = (cost.cost(c, 1.0) for c in same_load)
    assert slow_cost == pytest.approx(2 * fast_cost)
    cost.forget(slow)
    assert cost.cost(same_load[1], 1.0) == pytest.approx(fast_cost)


@pytest.mark.parametrize("count", [1, 255, 256, 700])
def test_steps_folded_in_batches_weigh_as_one_update_per_step(count):
    # the reference: each step decays what came before by one factor, as the fit promises
    truth, decay = TimingModel(), 0.99
    fit = TimingFit(scaled(truth, 2.0), decay=decay)
    reference = TimingFit(scaled(truth, 2.0), decay=decay)
    xtx, xty = np.zeros((6, 6)), np.zeros(6)
    for tokens, context, decoding, ms in steps(truth, count, seed=3):
        fit.observe(tokens, context, CAPACITY, decoding, ms)
        x = np.array(_features(tokens, min(1.0, context / CAPACITY), decoding))
        xtx, xty = decay * xtx + np.outer(x, x), decay * xty + x * ms
    reference._xtx, reference._xty, reference.observations = xtx, xty, count
    got, expected = fit.model(), reference.model()
    for name in ("prefill_a", "prefill_b", "prefill_c", "decode_a", "decode_b", "decode_c"):
        assert getattr(got, name) == pytest.approx(getattr(expected, name), rel=1e-9, abs=1e-12)
    # folding is idempotent: asking again changes nothing
    assert fit.model() == got
