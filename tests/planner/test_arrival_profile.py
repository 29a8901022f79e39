import pytest

from kvmesh.common.runtime.config import ConfigError
from kvmesh.replay.arrival_profile import parse_arrival_profile


def test_a_step_doubles_the_rate_after_its_time():
    profile = parse_arrival_profile("step:at=100,factor=2")
    assert profile.warp_ms(50_000) == pytest.approx(50_000, abs=1e-3)
    # 100 s of the trace after the step take 50 s at twice the rate
    assert profile.warp_ms(200_000) == pytest.approx(150_000, abs=1e-3)


def test_a_pulse_multiplies_the_rate_for_its_length_only():
    profile = parse_arrival_profile("pulse:at=30,for=60,factor=2")
    assert profile.warp_ms(20_000) == pytest.approx(20_000, abs=1e-3)
    # 120 s of the trace from 30 s on take the pulse's 60 s at twice the rate
    assert profile.warp_ms(150_000) == pytest.approx(90_000, abs=1e-3)
    assert profile.warp_ms(200_000) == pytest.approx(140_000, abs=1e-3)  # then the trace's own rate again


def test_a_sine_keeps_the_order_and_the_mean_rate():
    profile = parse_arrival_profile("sine:period=100,amplitude=0.5")
    times = [profile.warp_ms(t * 1000.0) for t in range(0, 1001, 7)]
    assert times == sorted(times)
    assert profile.warp_ms(1_000_000) == pytest.approx(1_000_000, rel=0.02)  # whole periods: same length
    # a quarter period in, the rate is above average: arrivals come sooner
    assert profile.warp_ms(40_000) < 40_000


@pytest.mark.parametrize(
    "text", ["sine:amplitude=1.5", "step:factor=0", "wave:period=3", "sine:period=x", "pulse:for=0"]
)
def test_bad_profiles_are_refused(text):
    with pytest.raises(ConfigError):
        parse_arrival_profile(text)


def test_no_profile_is_none():
    assert parse_arrival_profile("") is None


def test_a_phase_shifts_the_sine():
    shifted = parse_arrival_profile("sine:period=100,amplitude=0.5,phase=50")
    assert shifted.rate_factor(25.0) == pytest.approx(0.5)  # half a period on: the trough, not the crest
    assert shifted.cumulative(0.0) == 0.0
    assert shifted.warp_ms(100_000) == pytest.approx(100_000, abs=1e-3)  # a whole period keeps its length
    # a quarter period in, the rate was below average: arrivals come later
    assert shifted.warp_ms(40_000) > 40_000
