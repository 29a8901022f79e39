"""A fleet's step-time model: the fit of all its workers' steps, scaled to each worker's speed
(docs/decisions/0061), one speed for the workers of one speed class (docs/decisions/0062)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvmesh.common.core.fleet_timing import fleet_models
from kvmesh.common.core.timing import TimingModel, scaled
from kvmesh.common.core.timing_fit import TimingEvidence, TimingFit

LONG_PROMPT = 3000


def run_steps(fit: TimingFit, truth: TimingModel, speed: float, count: int, rng: random.Random) -> None:
    """Steps like a CPU engine's under contention: mostly short prefills and decodes, a long prompt
    now and then (3%), durations off by a log-normal factor (σ 0.6)."""
    for _ in range(count):
        draw = rng.random()
        tokens = 0 if draw < 0.5 else rng.randint(16, 600) if draw < 0.97 else rng.randint(1500, 4000)
        decoding = tokens == 0 or rng.random() < 0.8
        share = rng.random() * 0.3
        ms = truth.step_ms(tokens, int(share * 1000), 1000, decoding) * speed * rng.lognormvariate(0, 0.6)
        fit.observe(tokens, share, 1.0, decoding, ms)


def fitted_fleet(speeds: list[float], steps: int, seed: int) -> list[TimingFit]:
    truth = scaled(TimingModel(), 15.0)  # a CPU engine: far from the GPU prior
    rng = random.Random(seed)
    fits = [TimingFit(TimingModel()) for _ in speeds]
    for _ in range(steps):  # interleaved, as engines sharing the machine run
        for fit, speed in zip(fits, speeds, strict=True):
            run_steps(fit, truth, speed, 1, rng)
    return fits


@pytest.mark.parametrize("seed", range(4))
def test_equal_engines_fitted_together_are_costed_alike(seed):
    fits = fitted_fleet([1.0, 1.0, 1.0], 300, seed)
    own = [fit.model().prefill_ms(LONG_PROMPT) for fit in fits]
    pooled = fleet_models({i: fit.evidence() for i, fit in enumerate(fits)}, TimingModel())
    together = [pooled[i].prefill_ms(LONG_PROMPT) for i in range(3)]
    # apart, a long prompt's predictions spread by 1.12 to 2.07x over these seeds; together by 1.10 to 1.17x
    assert max(together) / min(together) < 1.2, (own, together)
    assert max(together) / min(together) < max(own) / min(own)


def test_a_slower_engine_is_still_costed_slower_by_its_factor():
    fits = fitted_fleet([1.0, 1.0, 1.0, 2.0], 2000, seed=7)
    pooled = fleet_models({i: fit.evidence() for i, fit in enumerate(fits)}, TimingModel())
    fast = np.mean([pooled[i].prefill_ms(LONG_PROMPT) for i in range(3)])
    assert pooled[3].prefill_ms(LONG_PROMPT) / fast == pytest.approx(2.0, rel=0.1)
    assert pooled[3].decode_ms(200, 1000, True) / pooled[0].decode_ms(200, 1000, True) == pytest.approx(2.0, rel=0.15)


def test_engines_of_one_class_share_one_speed_whatever_each_measured():
    # engine 2 is engine 0's and 1's kind but measured 1.6x slow (a busier host); engine 3 is a slower device
    fits = fitted_fleet([1.0, 1.0, 1.6, 2.0], 2000, seed=7)
    evidence = {i: fit.evidence() for i, fit in enumerate(fits)}
    apart = fleet_models(evidence, TimingModel())
    assert apart[2].prefill_ms(LONG_PROMPT) / apart[0].prefill_ms(LONG_PROMPT) == pytest.approx(1.6, rel=0.1)
    classed = fleet_models(evidence, TimingModel(), speed_classes={0: "a", 1: "a", 2: "a", 3: "b"})
    assert {classed[i].prefill_ms(LONG_PROMPT) for i in range(3)} == {classed[0].prefill_ms(LONG_PROMPT)}
    # class a's speed is its engines' together (about 1.2), and engine 3 keeps its own 2x against it
    ratio = classed[3].prefill_ms(LONG_PROMPT) / classed[0].prefill_ms(LONG_PROMPT)
    assert ratio == pytest.approx(2.0 / 1.2, rel=0.1)


def test_an_engine_that_has_barely_run_is_costed_at_the_fleets_speed():
    fits = fitted_fleet([1.0, 1.0, 3.0], 1000, seed=3)
    rng = random.Random(11)
    newcomer = TimingFit(TimingModel())
    run_steps(newcomer, scaled(TimingModel(), 15.0), 3.0, 3, rng)  # three steps of a slow engine
    evidence = {i: fit.evidence() for i, fit in enumerate(fits)} | {"new": newcomer.evidence()}
    pooled = fleet_models(evidence, TimingModel())
    pooled_without = fleet_models({i: fit.evidence() for i, fit in enumerate(fits)}, TimingModel())
    shape = pooled_without[0].prefill_ms(LONG_PROMPT) / pooled_without[0].prefill_ms(300)
    # its handful of steps barely move it from the pool's own fit (speed 1), toward its 3x
    speed = pooled["new"].prefill_ms(LONG_PROMPT) / fleet_models({"pool": _sum(evidence.values())}, TimingModel())[
        "pool"
    ].prefill_ms(LONG_PROMPT)
    assert 1.0 <= speed < 1.3
    assert pooled["new"].prefill_ms(LONG_PROMPT) / pooled["new"].prefill_ms(300) == pytest.approx(shape, rel=0.1)


def _sum(evidence) -> TimingEvidence:
    items = list(evidence)
    return TimingEvidence(sum(e.xtx for e in items), sum(e.xty for e in items), sum(e.steps for e in items))


def test_every_pooled_model_predicts_times_that_never_fall_with_more_work():
    fits = fitted_fleet([0.5, 1.0, 4.0], 300, seed=5)
    for model in fleet_models({i: fit.evidence() for i, fit in enumerate(fits)}, TimingModel()).values():
        prefill = [model.prefill_ms(tokens) for tokens in range(1, 9000, 500)]
        decode = [model.decode_ms(context, 1000, True) for context in range(0, 1001, 100)]
        assert min(prefill) >= 0 and prefill == sorted(prefill)
        assert min(decode) >= 0 and decode == sorted(decode)


def test_no_evidence_gives_no_models():
    assert fleet_models({}, TimingModel()) == {}


def test_evidence_survives_its_wire_form_and_a_malformed_one_is_refused():
    fit = fitted_fleet([1.0], 200, seed=1)[0]
    evidence = fit.evidence()
    back = TimingEvidence.from_wire(evidence.to_wire())
    assert np.allclose(back.xtx, evidence.xtx) and np.allclose(back.xty, evidence.xty)
    assert back.steps == pytest.approx(evidence.steps)
    wire = evidence.to_wire()
    for broken in (
        {**wire, "xtx": wire["xtx"][:-1]},
        {**wire, "xty": [*wire["xty"], 1.0]},
        {**wire, "steps": -1.0},
        {**wire, "xty": [float("nan")] * 6},
    ):
        with pytest.raises(ValueError):
            TimingEvidence.from_wire(broken)
    with pytest.raises((KeyError, TypeError)):
        TimingEvidence.from_wire({"xtx": wire["xtx"]})


def test_the_steps_count_decays_with_the_fit():
    fit = TimingFit(TimingModel(), decay=0.5)
    for _ in range(10):
        fit.observe(100, 0.0, 1.0, False, 20.0)
    assert fit.evidence().steps == pytest.approx(2.0, rel=0.01)  # 1 + 1/2 + 1/4 + ...
