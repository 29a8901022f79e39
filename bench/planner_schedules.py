"""How much could any schedule of the fleet save on the planner bench's setup? (hindsight, replayed)

``bench.planner_bench`` compares the planner with fixed fleets. This asks what a schedule that
knows the future could do on the same replay (shared trace, ``sine:period=500,amplitude=0.7`` at
speed-up 2, decisions every 15 s, workers starting 15 s after they are asked for): it replays
fixed schedules of pool sizes, one target per decision, through the same virtual fleet.

- ``--sine``: schedules that follow the arrival profile's own curve ``ceil(k·(1 + 0.7·sin(2π(t +
  lead)/500)))``, floored, for a grid of scale, lead and floor.
- ``--hindsight``: the planner's own schedule for the seed, then every schedule one worker smaller
  in one interval, then the cuts that kept the attainment above the larger fixed fleet's rival
  (fixed 5's 0.964) applied together, least harmful first.

For each it prints the SLA attainment, the worker-seconds and the saving against the smallest fixed
fleet reaching that attainment (fixed 5 and 6: their attainment and worker-seconds are replayed
first).

    python -m bench.planner_schedules [--seed 0] [--sine] [--hindsight]

``--smoke``: the first ``SMOKE_REQUESTS`` requests of the trace only (CI): the figures mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from concurrent.futures import ProcessPoolExecutor

from bench.planner_bench import TRACE
from kvmesh.planner.decision import Decision, PoolSizes
from kvmesh.planner.load import IntervalObservation
from kvmesh.planner.planner import Planner
from kvmesh.profiler.mock import profile_mock_engine
from kvmesh.replay.config import ReplayConfig
from kvmesh.replay.mooncake_trace import read_trace
from kvmesh.replay.report import sla_attainment
from kvmesh.replay.simulator import ReplaySimulator

PROFILE, SPEEDUP, INTERVAL_S, PERIOD_S, AMPLITUDE = "sine:period=500,amplitude=0.7", 2.0, 15.0, 500.0, 0.7
SMOKE_REQUESTS = 300


def config(seed: int, first: int) -> ReplayConfig:
    replay = ReplayConfig(
        arrival_profile=PROFILE,
        arrival_speedup_ratio=SPEEDUP,
        seed=seed,
        planner=True,
        workers=first,
        adjustment_interval=INTERVAL_S,
        worker_startup_secs=INTERVAL_S,
        load_predictor="constant",
    )
    replay.validate()
    return replay


class ScheduledPlanner(Planner):
    """The planner, except that decision ``i`` sets the pool to ``schedule[i]`` workers (the last
    entry holds once the schedule runs out): the replay's virtual connector carries it out as it
    would the planner's own targets."""

    def __init__(self, replay: ReplayConfig, simulator: ReplaySimulator, schedule: list[int]) -> None:
        super().__init__(replay, profile_mock_engine(simulator.engine_config))
        self.schedule = schedule
        self.decided = 0

    def step(self, observation: IntervalObservation, current: PoolSizes) -> Decision:
        decision = super().step(observation, current)
        self.decided += 1
        size = self.schedule[min(self.decided, len(self.schedule) - 1)]
        return dataclasses.replace(decision, target=PoolSizes(aggregated=size))


def replay(job: tuple[list[int] | None, int, int | None]) -> tuple[float, float, list[int]]:
    """(attainment, worker-seconds, the schedule the fleet followed) of one schedule (None: the
    planner's own decisions), for a seed, on the trace (or its first ``limit`` requests)."""
    schedule, seed, limit = job
    replay_config = config(seed, schedule[0] if schedule else 4)
    simulator = ReplaySimulator(replay_config)
    if schedule is None:
        simulator.attach_planner(Planner(replay_config, profile_mock_engine(simulator.engine_config)))
    else:
        simulator.attach_planner(ScheduledPlanner(replay_config, simulator, schedule))
    records = simulator.run(read_trace(TRACE)[:limit])
    end_ms = max(r.last_token_ms for r in records)
    assert simulator.fleet is not None
    followed = [replay_config.workers] + [point["target"] for point in simulator.fleet.timeline]
    return sla_attainment(records, 2000, 50), simulator.fleet.worker_seconds(end_ms), followed


def sine_schedule(scale: float, lead_s: float, floor: int, decisions: int = 40) -> list[int]:
    return [
        max(floor, math.ceil(scale * (1 + AMPLITUDE * math.sin(2 * math.pi * (INTERVAL_S * i + lead_s) / PERIOD_S))))
        for i in range(decisions)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="the replay's seed (the router's tie-breaking)")
    parser.add_argument("--sine", action="store_true", help="replay the schedules that follow the profile's curve")
    parser.add_argument("--hindsight", action="store_true", help="cut the planner's own schedule, interval by interval")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="a short trace (CI): the figures mean nothing")
    args = parser.parse_args()
    limit = SMOKE_REQUESTS if args.smoke else None
    with ProcessPoolExecutor(args.jobs) as pool:
        (five, five_s, _), (six, six_s, _) = pool.map(replay, [([5], args.seed, limit), ([6], args.seed, limit)])

        def show(label: str, attained: float, seconds: float) -> None:
            rival = (six, six_s) if attained > five else (five, five_s) if attained >= 0.95 else None
            saving = f"{1 - seconds / rival[1]:.1%} fewer than fixed {6 if rival[0] == six else 5}" if rival else "-"
            print(f"{label:<48} {attained:.4f} {seconds:7.0f}   {saving}")

        print(f"seed {args.seed}: fixed 5 {five:.4f} ({five_s:.0f} worker-s), fixed 6 {six:.4f} ({six_s:.0f})")
        if args.sine:
            grid = [(k, lead, floor) for k in (3.0, 3.25, 3.5, 3.75) for lead in (15.0, 30.0) for floor in (2, 3)]
            results = pool.map(replay, [(sine_schedule(*g), args.seed, limit) for g in grid])
            for (k, lead, floor), (attained, seconds, _) in zip(grid, results, strict=True):
                show(f"sine schedule: scale {k}, lead {lead:g} s, floor {floor}", attained, seconds)
        if args.hindsight:
            attained, seconds, own = replay((None, args.seed, limit))
            show("the planner", attained, seconds)
            cuts = [i for i in range(1, len(own)) if own[i] > 1]
            cut_schedules = [[size - (j == i) for j, size in enumerate(own)] for i in cuts]
            results = list(pool.map(replay, [(s, args.seed, limit) for s in cut_schedules]))
            kept = sorted(((r[0], i) for i, r in zip(cuts, results, strict=True) if r[0] > five), reverse=True)
            print(f"single cuts that stay above fixed 5's attainment: {[i for _, i in kept]}")
            combined = [[i for _, i in kept[:n]] for n in range(2, len(kept) + 1)]
            schedules = [[size - (j in chosen) for j, size in enumerate(own)] for chosen in combined]
            results = list(pool.map(replay, [(s, args.seed, limit) for s in schedules]))
            for chosen, (attained, seconds, _) in zip(combined, results, strict=True):
                show(f"cut at decisions {chosen}", attained, seconds)


if __name__ == "__main__":
    main()
