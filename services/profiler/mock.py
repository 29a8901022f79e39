"""Profile the mock engine by running it: the measured points, not its formula, go into the profile
(a test checks that they agree with the timing model the engine runs on)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvmesh.common.core.engine_profile import DecodePoint, EngineProfile, PrefillPoint
from kvmesh.common.core.timing import TimingModel
from kvmesh.worker.engine import EngineRequestSpec
from kvmesh.worker.engines.mock.mock_engine import EngineConfig, MockEngine

PREFILL_TOKENS = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
CONCURRENCY = (1, 8, 32, 64, 128, 256)
CONTEXT_TOKENS = (512, 2048, 8192, 16384)
DECODE_STEPS_MEASURED = 16

_token_source = itertools.count(1)


def _prompt(length: int) -> list[int]:
    """Tokens no other prompt shares, so nothing is served from the cache by accident."""
    start = next(_token_source) * 1_000_003
    return [(start + i) % 2_000_000_000 + 1 for i in range(length)]


def measure_ttft(config: EngineConfig, uncached_tokens: int) -> float:
    """Arrival to first token of one prompt on an idle engine, in simulated ms."""
    engine = MockEngine(config)
    engine.add_request(EngineRequestSpec("p", _prompt(uncached_tokens), 1))
    elapsed = 0.0
    while True:
        result = engine.step()
        elapsed += result.duration_ms
        if result.outputs:
            return elapsed


def measure_itl(config: EngineConfig, concurrency: int, context_tokens: int) -> float | None:
    """Mean decode step time with ``concurrency`` sequences of ``context_tokens`` (None when they do
    not fit in the KV cache at once)."""
    needed_blocks = concurrency * (context_tokens // config.block_size + 2)
    if concurrency > config.max_num_seqs or needed_blocks > config.num_blocks:
        return None
    engine = MockEngine(config)
    for i in range(concurrency):
        engine.add_request(EngineRequestSpec(f"d{i}", _prompt(context_tokens), 10_000))
    # run the prefills to completion, then time steps that only decode
    while engine.waiting or any(r.num_computed < len(r.prompt) for r in engine.running):
        engine.step()
    durations = []
    for _ in range(DECODE_STEPS_MEASURED):
        result = engine.step()
        if result.prefill_tokens:
            continue
        durations.append(result.duration_ms)
    return sum(durations) / len(durations)


def profile_mock_engine(
    config: EngineConfig | None = None,
    prefill_tokens: Sequence[int] = PREFILL_TOKENS,
    concurrency: Sequence[int] = CONCURRENCY,
    context_tokens: Sequence[int] = CONTEXT_TOKENS,
) -> EngineProfile:
    config = config or EngineConfig(timing=TimingModel())
    prefill = tuple(PrefillPoint(n, measure_ttft(config, n)) for n in prefill_tokens)
    decode = []
    for c in concurrency:
        for length in context_tokens:
            itl = measure_itl(config, c, length)
            if itl is not None:
                decode.append(DecodePoint(c, length, itl))
    return EngineProfile(
        engine="mock",
        prefill=prefill,
        decode=tuple(decode),
        max_num_batched_tokens=config.max_num_batched_tokens,
        capacity_tokens=config.num_blocks * config.block_size,
        notes={"block_size": config.block_size, "speedup_ratio": config.timing.speedup_ratio},
    )
