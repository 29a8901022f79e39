"""The mock engine's loop keeps its timing model's pace on the services' event loop (uvloop): its
timers run to the nearest millisecond, so a step modelled far shorter than that (a fast
``--speedup-ratio``) would not wait at all, and the engine would run ahead of its model."""

from __future__ import annotations

import asyncio
import time

import pytest
import uvloop

from kvmesh.worker.config import WorkerConfig
from kvmesh.worker.engine import EngineRequestSpec, TokenOutput
from kvmesh.worker.engines.mock.engine_loop import SCHEDULE_SLACK_S, MockEngineLoop
from kvmesh.worker.engines.mock.setup import build_mock_engine


async def served_against_model(speedup: float, clients: int, requests: int) -> tuple[float, float]:
    """(wall seconds, the model's seconds) for ``clients`` concurrent clients that each send
    ``requests`` short requests, one after the other."""
    loop = MockEngineLoop(build_mock_engine(WorkerConfig(speedup_ratio=speedup)), publisher=None)
    modelled: list[float] = []
    step = loop.engine.step

    def timed_step():
        result = step()
        modelled.append(result.duration_ms / 1000.0)
        return result

    loop.engine.step = timed_step
    await loop.start()
    try:

        async def client(c: int) -> None:
            for r in range(requests):
                prompt = [100_000 * c + 1000 * r + t for t in range(200)]
                queue = loop.submit(EngineRequestSpec(f"r{c}-{r}", prompt, max_tokens=8, ignore_eos=True))
                while True:
                    output = await queue.get()
                    assert isinstance(output, TokenOutput)
                    if output.finish_reason is not None:
                        break

        started = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(client(c) for c in range(clients))), timeout=60)
        return time.perf_counter() - started, sum(modelled)
    finally:
        await loop.stop()


@pytest.mark.parametrize("clients", [1, 4])
def test_steps_far_shorter_than_a_timer_tick_still_take_the_models_time(clients: int):
    # at this speed-up a decode step is modelled at under a tenth of a millisecond: alone, not waited at all
    wall, modelled = uvloop.run(served_against_model(speedup=100, clients=clients, requests=100))
    assert modelled > 0.02  # enough steps for the rounding to matter
    # never ahead of the model by more than the slack one rounded wait may leave
    assert wall >= modelled - 2 * SCHEDULE_SLACK_S
