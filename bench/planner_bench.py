"""Does the planner meet the SLA with fewer worker-seconds than a fixed fleet? (``kvmesh replay``)

On the shared trace with a time-varying arrival rate (default: a sinusoid, period 500 s, amplitude
0.7, at arrival speed-up 2), replays every fixed fleet size in a range and the planner with each load
predictor (workers start 15 s after the planner asks, decisions every 15 s), and prints for each:
SLA attainment (TTFT ≤ 2 s and mean ITL ≤ 50 ms), worker-seconds, and for the planner the smallest
fixed fleet reaching at least its attainment and how many worker-seconds fewer the planner used.
A fleet's attainment moves by a point or more with the router's tie-breaking, and the comparison
jumps with it from one fixed size to the next: ``--seeds`` repeats everything per seed and prints
the mean and the least saving. ``--max-workers`` caps the planner, e.g. at the fleet an operator
would otherwise provision for the peak, and ``--start-workers`` sets the fleet it starts with
(docs/decisions/0013, "The goal, with the peak provision as the planner's ceiling").

    python -m bench.planner_bench [--profile sine:period=500,amplitude=0.7] [--fixed 4 8] [--seeds 0 1 2]
    python -m bench.planner_bench --arrival-speedup-ratio 1 --profile sine:period=1000,amplitude=0.9,phase=500 \
        --fixed 2 5 --seeds 0 1 2 --start-workers 2 --max-workers 4
"""

from __future__ import annotations

import argparse
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from kvmesh.planner.planner import Planner
from kvmesh.planner.predictors import PREDICTORS
from kvmesh.profiler.mock import profile_mock_engine
from kvmesh.replay.config import ReplayConfig
from kvmesh.replay.mooncake_trace import read_trace
from kvmesh.replay.report import sla_attainment
from kvmesh.replay.simulator import ReplaySimulator

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"

Result = tuple[str, float, float, int]  # label, SLA attainment, worker-seconds, largest pool


def replay(setup: tuple[str, dict]) -> Result:
    """(label, SLA attainment, worker-seconds, largest pool)."""
    label, options = setup
    config = ReplayConfig(**options)
    config.validate()
    simulator = ReplaySimulator(config)
    if config.planner:
        profile = profile_mock_engine(simulator.engine_config)
        simulator.attach_planner(Planner(config, profile, disaggregated=config.prefill_workers > 0))
    records = simulator.run(read_trace(TRACE))
    end_ms = max(r.last_token_ms for r in records)
    if simulator.fleet is not None:
        seconds = simulator.fleet.worker_seconds(end_ms)
        largest = max(p["workers"] for p in simulator.fleet.timeline)
    else:
        fleet_size = config.workers + config.prefill_workers
        seconds, largest = fleet_size * end_ms / 1000, fleet_size
    return label, sla_attainment(records, config.ttft_target_ms, config.itl_target_ms), seconds, largest


def compare(planned: Result, fixed: list[Result]) -> tuple[Result, float] | None:
    """The smallest fixed fleet whose attainment is at least the planner's, and how many
    worker-seconds fewer (a share) the planner used; None when no fixed fleet in range reaches it."""
    match = next((f for f in fixed if f[1] >= planned[1]), None)
    return None if match is None else (match, 1 - planned[2] / match[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="sine:period=500,amplitude=0.7", help="--arrival-profile of the runs")
    parser.add_argument("--arrival-speedup-ratio", type=float, default=2.0)
    parser.add_argument("--fixed", type=int, nargs=2, default=(4, 8), metavar=("LOW", "HIGH"), help="fleet sizes")
    parser.add_argument("--interval", type=float, default=15.0, help="planner: --adjustment-interval")
    parser.add_argument("--startup", type=float, default=15.0, help="planner: --worker-startup-secs")
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0],
        help="replay seeds (the router's tie-breaking): one comparison per seed, then their mean",
    )
    parser.add_argument("--start-workers", type=int, default=4, help="planner: the workers it starts with (--workers)")
    parser.add_argument(
        "--max-workers",
        type=int,
        default=16,
        help="planner: --max-workers, e.g. the fleet an operator would otherwise provision for the peak",
    )
    parser.add_argument("--jobs", type=int, default=2, help="replays run in parallel")
    args = parser.parse_args()
    setups = []
    for seed in args.seeds:
        common = {"arrival_profile": args.profile, "arrival_speedup_ratio": args.arrival_speedup_ratio, "seed": seed}
        setups += [(f"fixed {n}", {**common, "workers": n}) for n in range(args.fixed[0], args.fixed[1] + 1)]
        planned = {"planner": True, "workers": args.start_workers, "adjustment_interval": args.interval}
        planned.update(worker_startup_secs=args.startup, max_workers=args.max_workers)
        setups += [(f"planner {p}", {**common, **planned, "load_predictor": p}) for p in PREDICTORS]
        # NVIDIA Dynamo's throughput-based scaling as its planner design describes it, same predictor
        setups.append(
            ("dynamo-style constant", {**common, **planned, "load_predictor": "constant", "sizing": "dynamo"})
        )
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(replay, setups))
    print(f"trace {TRACE.name}, speed-up {args.arrival_speedup_ratio}, arrival profile {args.profile}")
    print(f"planner: starts with {args.start_workers} workers, at most {args.max_workers}")
    per_seed = len(results) // len(args.seeds)
    savings: dict[str, list[float | None]] = {}
    for i, seed in enumerate(args.seeds):
        batch = results[i * per_seed : (i + 1) * per_seed]
        fixed = [r for r in batch if r[0].startswith("fixed")]
        print(f"\nseed {seed}")
        print(f"{'setup':<26} {'SLA attainment':>14} {'worker-s':>9} {'max pool':>8}   vs fixed fleet")
        for result in batch:
            label, attained, seconds, largest = result
            line = f"{label:<26} {attained:14.3f} {seconds:9.0f} {largest:8d}"
            if not label.startswith("fixed"):
                compared = compare(result, fixed)
                savings.setdefault(label, []).append(compared[1] if compared else None)
                if compared is not None:
                    match, fewer = compared
                    line += f"   {match[0]} ({match[1]:.3f}, {match[2]:.0f} s): {fewer:.1%} fewer"
                else:
                    line += "   no fixed fleet in range reaches it"
            print(line)
    if len(args.seeds) > 1:
        print(f"\nover seeds {' '.join(map(str, args.seeds))}: worker-seconds fewer than the fixed fleet each matched")
        for label, shares in savings.items():
            known = [s for s in shares if s is not None]
            if known:
                mean = sum(known) / len(known)
                print(f"{label:<26} mean {mean:.1%}, least {min(known):.1%} ({len(known)} of {len(shares)} matched)")


if __name__ == "__main__":
    main()
