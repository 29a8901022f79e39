"""Does the planner keep its SLA with fewer worker-seconds than the fleet an operator would size?

For each case — a trace (given on the command line, the shared one by default, and with ``--family``
the variants of :mod:`kvmesh.replay.trace_family`), an arrival profile that starts in its trough or at
its crest, aggregated or disaggregated — ``kvmesh replay``'s simulator finds the smallest fixed fleet
whose SLA attainment (TTFT ≤ 2 s and mean ITL ≤ 50 ms) reaches the goal (0.95) within ``--most``
workers a pool, then runs the planner as an operator would: starting at 2 workers a pool, capped at
``--most`` (the largest fleet they would pay for: 16 by default; ``--cap-at-fleet`` caps it at the
fleet found, which no operator knows), and NVIDIA Dynamo's throughput sizing as the project models it
under the same cap. It prints, per case and seed: the fleet (and one worker fewer), each planner's
attainment, its worker-seconds, the share it saved against the fleet, and the prefix reuse of the
requests that arrived in the interval before its shrinks and in the one after (what a worker leaving
with its cache costs), and how far its rate forecast was from the rate then observed (the error's
mean size, and its mean sign while the load rose and while it fell). The planner's goal: attainment
at least the goal wherever the fleet reaches it, with as many worker-seconds saved as that allows.

``--sizings moves`` adds kvmesh's planner with the cache moves of the replay (docs/decisions/0051): a
shrink hands its hottest blocks to the survivors and a started worker imports the busiest workers'
before it serves (``--move-blocks`` each).

A disaggregated fleet is (prefill, decode): the smallest prefill pool P that reaches the goal with a
generous decode pool, then for P, P + 1 and P + 2 the smallest decode pool reaching it, the smallest
total of those; the planner is capped at each pool.

    python -m bench.planner_bench                                  # the shared trace, trough first
    python -m bench.planner_bench TRACE.jsonl --phases trough crest --seeds 0 1 2
    python -m bench.planner_bench --family --phases trough crest --modes aggregated disaggregated
    python -m bench.planner_bench --family --phases trough crest --sizings queue moves dynamo
    python -m bench.planner_bench --smoke   # first 300 requests, fleets up to 4 (CI; figures mean nothing)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import tempfile
import threading
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvmesh.planner.planner import Planner
from kvmesh.profiler.mock import profile_mock_engine
from kvmesh.replay.config import ReplayConfig
from kvmesh.replay.fleet_search import Fleet, planned, profile_of, smallest_fleet
from kvmesh.replay.mooncake_trace import read_trace
from kvmesh.replay.report import forecast_errors, sla_attainment
from kvmesh.replay.simulator import ReplaySimulator
from kvmesh.replay.trace_family import VARIANTS, write_variant

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
SMOKE_REQUESTS = 300  # --smoke: requests of each trace
GOAL = 0.95
PHASES = ("trough", "crest")
MODES = ("aggregated", "disaggregated")
SIZING_OF = {"queue": "queue", "dynamo": "dynamo", "moves": "queue"}  # a planner's name -> its --sizing


@dataclass(frozen=True)
class Result:
    attainment: float
    worker_seconds: float
    largest: int  # the most workers it ran at once
    # prefix reuse of the requests that arrived in the interval before each shrink, and in the one
    # after (None: no shrink): what a worker leaving with its cache costs the sessions it served
    reuse_before_shrinks: float | None = None
    reuse_after_shrinks: float | None = None
    # the planner's rate forecast against the rate then observed, (forecast - observed) / observed:
    # mean of its size, and mean while the load rose and while it fell (None: no such interval)
    forecast_error: float | None = None
    forecast_bias_rising: float | None = None
    forecast_bias_falling: float | None = None


def reuse_around_shrinks(records, timeline: list[dict], interval_s: float) -> tuple[float | None, float | None]:
    shrinks = [p["t_s"] * 1000 for p in timeline if p["target"] < p["workers"]]
    if not shrinks:
        return None, None

    def reuse(windows: list[tuple[float, float]]) -> float:
        chosen = [r for r in records if not r.refused and any(a <= r.arrival_ms < b for a, b in windows)]
        prompt = sum(r.input_length for r in chosen)
        return sum(r.cached_tokens for r in chosen) / prompt if prompt else 0.0

    width = interval_s * 1000
    return reuse([(t - width, t) for t in shrinks]), reuse([(t, t + width) for t in shrinks])


def replay(trace: Path, options: dict) -> Result:
    """One ``kvmesh replay`` of ``trace`` with ``options`` (ReplayConfig fields)."""
    config = ReplayConfig(**options)
    config.validate()
    simulator = ReplaySimulator(config)
    if config.planner:
        profile = profile_mock_engine(simulator.engine_config)
        simulator.attach_planner(Planner(config, profile, disaggregated=config.prefill_workers > 0))
    records = simulator.run(read_trace(trace))
    end_ms = max(r.last_token_ms for r in records)
    attainment = sla_attainment(records, config.ttft_target_ms, config.itl_target_ms)
    if simulator.fleet is not None:
        seconds = simulator.fleet.worker_seconds(end_ms)
        largest = max(p["workers"] for p in simulator.fleet.timeline)
        around = reuse_around_shrinks(records, simulator.fleet.timeline, config.adjustment_interval)
        return Result(attainment, seconds, largest, *around, *forecast_errors(simulator.fleet.timeline))
    size = config.workers + config.prefill_workers
    return Result(attainment, size * end_ms / 1000, size)


def _replay(job: tuple[Path, dict]) -> Result:
    return replay(*job)


class Runs:
    """Replays on a process pool, each setup run once (the searches ask for some twice). With a
    ``cache`` file, fixed fleets' results are kept there between runs, keyed by the trace's content
    and the options (they do not depend on the planner, which is what one iterates on)."""

    def __init__(self, pool: Executor, cache: Path | None = None) -> None:
        self._pool = pool
        self._done: dict[tuple, Future[Result]] = {}
        self._cache_path = cache
        self._cache: dict[str, list] = json.loads(cache.read_text()) if cache and cache.is_file() else {}
        self._lock = threading.Lock()

    def run(self, trace: Path, options: dict) -> Result:
        digest = hashlib.sha256(trace.read_bytes()).hexdigest()[:16]
        key = json.dumps([digest, sorted(options.items())])
        with self._lock:
            if key in self._cache:
                return Result(*self._cache[key])
            if key not in self._done:
                self._done[key] = self._pool.submit(_replay, (trace, options))
            future = self._done[key]
        result = future.result()
        if self._cache_path is not None and not options.get("planner"):
            with self._lock:
                self._cache[key] = [result.attainment, result.worker_seconds, result.largest]  # no shrinks
                self._cache_path.write_text(json.dumps(self._cache))
        return result


def percent(value: float | None, signed: bool = False) -> str:
    return "-" if value is None else f"{value:{'+' if signed else ''}.0%}"


def case_rows(runs: Runs, args: argparse.Namespace, trace: Path, phase: str, mode: str) -> list[str]:
    rows = []
    for seed in args.seeds:
        common = {
            "arrival_profile": profile_of(phase, args.period, args.amplitude),
            "arrival_speedup_ratio": args.arrival_speedup_ratio,
            "seed": seed,
        }
        name = f"{trace.stem} {phase} {mode[:5]} s{seed}"
        disaggregated = mode == "disaggregated"
        largest = Fleet(args.most if disaggregated else 0, args.most)
        best = runs.run(trace, {**common, **largest.options()}).attainment
        # where no fleet reaches the goal (a prefill alone outlasts the target), the goal is what the
        # largest fleet reaches, less a point: the planner must still keep what a fleet can
        goal = GOAL if best >= GOAL else math.floor((best - 0.01) * 1000) / 1000
        fleet = smallest_fleet(
            lambda f, common=common: runs.run(trace, {**common, **f.options()}).attainment,
            disaggregated,
            args.most,
            goal,
        )
        if fleet is None:
            rows.append(f"{name:<48} no fleet of at most {args.most} a pool reaches {goal}")
            continue
        name += "" if goal == GOAL else f" (goal {goal})"
        fixed = runs.run(trace, {**common, **fleet.options()})
        fewer = Fleet(fleet.prefill, fleet.decode - 1)
        below = runs.run(trace, {**common, **fewer.options()}).attainment if fewer.decode else float("nan")
        line = f"{name:<48} {fleet!s:>8} {fixed.attainment:6.3f} {below:6.3f} {fixed.worker_seconds:8.0f}"
        ceiling = None if args.cap_at_fleet else Fleet(args.most if disaggregated else 0, args.most)
        for sizing in args.sizings:
            options = planned(fleet, args.start_workers, SIZING_OF[sizing], args.interval, args.startup, ceiling)
            if sizing == "moves":
                options |= {"shrink_handoff_blocks": args.move_blocks, "join_warmup_blocks": args.move_blocks}
            result = runs.run(trace, {**common, **options})
            saved = 1 - result.worker_seconds / fixed.worker_seconds
            mark = "-" if goal < GOAL else (" " if result.attainment >= goal else "!")
            line += f"   {result.attainment:6.3f}{mark} {result.worker_seconds:8.0f} {saved:6.1%}"
            before, after = result.reuse_before_shrinks, result.reuse_after_shrinks
            line += f" {'-' if before is None else f'{before:.2f}>{after:.2f}':>9}"
            line += f" {percent(result.forecast_error):>5}/{percent(result.forecast_bias_rising, signed=True):>5}"
            line += f"/{percent(result.forecast_bias_falling, signed=True):>5}"
        rows.append(line)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="*", type=Path, help="traces to replay (JSONL; default: the shared trace)")
    parser.add_argument("--family", action="store_true", help="add the trace family's variants of the first trace")
    parser.add_argument("--family-seed", type=int, default=0, help="the seed the family's bursty variant is drawn with")
    parser.add_argument("--phases", nargs="+", default=["trough"], choices=PHASES, help="where the profile starts")
    parser.add_argument("--modes", nargs="+", default=["aggregated"], choices=MODES)
    parser.add_argument("--period", type=float, default=1000.0, help="the sinusoidal profile's period (s)")
    parser.add_argument("--amplitude", type=float, default=0.9, help="the sinusoidal profile's amplitude")
    parser.add_argument("--arrival-speedup-ratio", type=float, default=1.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="replay seeds (the router's tie-breaking)")
    parser.add_argument(
        "--start-workers",
        type=int,
        default=2,
        help="planner: the workers a pool starts with, as an operator starting small (0: its cap, as an operator "
        "starting a planner on a running fleet; it shrinks once it has measured headroom)",
    )
    parser.add_argument(
        "--cap-at-fleet",
        action="store_true",
        help="cap the planners at the smallest fixed fleet that reaches the goal (found by the search, which no "
        "operator knows) instead of at --most",
    )
    parser.add_argument("--interval", type=float, default=15.0, help="planner: --adjustment-interval")
    parser.add_argument("--startup", type=float, default=15.0, help="planner: --worker-startup-secs")
    parser.add_argument(
        "--sizings",
        nargs="+",
        default=["queue", "dynamo"],
        choices=list(SIZING_OF),
        help="planners to run: kvmesh's (queue), Dynamo-style (dynamo), and kvmesh's with the cache moves (moves: "
        "a shrink hands its cache on and a join starts warm, --move-blocks blocks each)",
    )
    parser.add_argument("--move-blocks", type=int, default=4096, help="with --sizings moves: blocks a move carries")
    parser.add_argument(
        "--most",
        type=int,
        default=16,
        help="the largest pool an operator would pay for: the fleet search's bound and the planners' cap",
    )
    parser.add_argument("--jobs", type=int, default=2, help="replays run in parallel")
    parser.add_argument("--cache", type=Path, help="a JSON file keeping fixed fleets' results between runs")
    parser.add_argument("--smoke", action="store_true", help="short traces, small fleets (CI): figures mean nothing")
    args = parser.parse_args()
    traces = list(args.traces) or [TRACE]
    with tempfile.TemporaryDirectory(prefix="kvmesh-family-") as scratch:
        if args.smoke:
            args.most = min(args.most, 4)
            cut = []
            for i, trace in enumerate(traces):
                lines = trace.read_text().splitlines(keepends=True)[:SMOKE_REQUESTS]
                cut.append(Path(scratch) / f"smoke-{i}.jsonl")
                cut[-1].write_text("".join(lines))
            traces = cut
        if args.family:
            traces += [
                write_variant(traces[0], variant, Path(scratch) / f"{variant}.jsonl", args.family_seed)
                for variant in VARIANTS
            ]
        cases = [(trace, phase, mode) for trace in traces for mode in args.modes for phase in args.phases]
        with ProcessPoolExecutor(args.jobs) as pool, ThreadPoolExecutor(len(cases)) as searches:
            runs = Runs(pool, args.cache)
            tables = list(searches.map(lambda case: case_rows(runs, args, *case), cases))
    print(
        f"speed-up {args.arrival_speedup_ratio}, sine period {args.period:g} s amplitude {args.amplitude:g}; "
        f"planners start at {args.start_workers or 'their cap'} a pool, capped at "
        f"{'the fleet' if args.cap_at_fleet else f'{args.most} a pool'}; goal {GOAL}"
    )
    sizing_heads = "".join(
        f"   {s:>6}  {'worker-s':>8} {'saved':>6} {'hit ±shr':>9} {'fc err/rise/fall':>17}" for s in args.sizings
    )
    print(f"{'case':<48} {'fleet':>8} {'attain':>6} {'1 less':>6} {'worker-s':>8}{sizing_heads}")
    for rows in tables:
        for row in rows:
            print(row)
    print(
        f"(! marks a planner below {GOAL} where the fleet reaches it; - a case where no fleet does: its fleet is "
        "the smallest within 0.01 of the largest's attainment, a reference without a pass mark; hit ±shr: the "
        "prefix reuse of the requests that arrived in the interval before the planner's shrinks > in the one after; "
        "fc err/rise/fall: its rate forecast against the rate then observed, the mean size of the error, and its mean "
        "while the load rose and while it fell, + for too much)"
    )


if __name__ == "__main__":
    main()
