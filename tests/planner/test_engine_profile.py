import math

import pytest

from kvmesh.common.core.engine_profile import EngineProfile, ProfileError
from kvmesh.common.core.timing import TimingModel
from kvmesh.profiler.mock import profile_mock_engine
from kvmesh.worker.engines.mock.mock_engine import EngineConfig

CONFIG = EngineConfig(timing=TimingModel())


@pytest.fixture(scope="module")
def profile() -> EngineProfile:
    return profile_mock_engine(CONFIG)


def test_the_mock_profile_agrees_with_the_timing_model(profile):
    timing = CONFIG.timing
    for point in profile.prefill:
        # the engine prefills in chunks of its token budget: the model's time for each chunk
        full, rest = divmod(point.uncached_tokens, CONFIG.max_num_batched_tokens)
        chunks = [CONFIG.max_num_batched_tokens] * full + ([rest] if rest else [])
        assert point.ttft_ms == pytest.approx(sum(timing.prefill_ms(c) for c in chunks), rel=1e-9)
    capacity = CONFIG.num_blocks * CONFIG.block_size
    for point in profile.decode:
        expected = timing.decode_ms(point.concurrency * point.context_tokens, capacity, True)
        assert point.itl_ms == pytest.approx(expected, rel=0.02)  # contexts grow by a token a step


def test_estimates_interpolate_between_measured_points(profile):
    low, high = profile.prefill[2], profile.prefill[3]
    middle = (low.uncached_tokens + high.uncached_tokens) / 2
    assert low.ttft_ms < profile.ttft_ms(middle) < high.ttft_ms
    assert profile.itl_ms(64, 8192) > profile.itl_ms(8, 512) > 0
    assert profile.ttft_ms(0) >= 0 and math.isfinite(profile.ttft_ms(200_000))


def test_a_profile_survives_its_file(profile, tmp_path):
    path = tmp_path / "profile.json"
    profile.save(path)
    assert EngineProfile.load(path) == profile


def test_a_broken_profile_file_is_refused(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text('{"version": 99}')
    with pytest.raises(ProfileError, match="version"):
        EngineProfile.load(path)
    path.write_text("not json")
    with pytest.raises(ProfileError, match="cannot read"):
        EngineProfile.load(path)
