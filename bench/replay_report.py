"""Routing quality by replay: the Mooncake synthetic trace and session-structured families, each
policy next to NVIDIA Dynamo 1.6.1's own replay and the reuse bounds.

Part ``shared``: ``kvmesh replay``'s simulator for every router mode (round-robin, random, SGLang's
power-of-two and cache-aware, kv with our default predicted-TTFT cost and duplicate penalty,
without the penalty, and with Dynamo's block formula) on the shared trace at arrival speed-ups 4
(moderate) and 6 (heavy), with Dynamo's mocker configuration (8 workers, 64-token blocks, 16,384
blocks, 256 sequences, 8,192 batched tokens), then the time of a 12,000-request replay (the trace
three times over, back to back).

Part ``families``: traces made by ``kvmesh.replay.session_trace`` from the rules and seeds below
(chats, agent loops, a tenant mix, and two families held out from tuning), each with a cache size
and arrival speed that load the fleet; round-robin, cache-aware, kv (its default duplicate penalty),
kv with ``--kv-duplicate-penalty 0``, and Dynamo's ``kv_router`` replay of the same file when its
virtualenv is there (``--dynamo-python``; ``../shared/peers/README.md`` installs it). ``--draws 0
100`` also replays each family drawn anew (its rules' seed plus 100: traffic no default was tuned
on), ``--replay-seeds 0 1 2`` reports each figure as the mean over those replay seeds (a p99 moves by
a few ms between them), ``--jobs 2`` replays on two processes, ``--cache-replies`` caches each
turn's reply on the worker that served it (``kvmesh replay --cache-replies``, decision 75; Dynamo's
replay has no such rule and is left out then). Under each trace a verdict line says
whether the default matches the best of plain kv and cache-aware in every column, as printed
(issue 45's first item), and the last lines how many traces it does so on and, per column, its
margin on the best rival over all the traces: the mean, a 95% interval that resamples the traces,
and on how many it is ahead and behind (``kvmesh.replay.report.pooled_margins``).

    python -m bench.replay_report [--part shared|families] [--trace ../shared/data/mooncake_synthetic_trace.jsonl]

``--smoke``: the same code paths on the first ``SMOKE_REQUESTS`` requests of each trace and families
of a hundredth the sessions (seconds, for CI); its figures are not the published ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from kvmesh.replay.bounds import reuse_bounds
from kvmesh.replay.config import ReplayConfig
from kvmesh.replay.mooncake_trace import TraceRequest, read_trace
from kvmesh.replay.report import closest_margin, pooled_margins, shortfalls, summarise
from kvmesh.replay.session_trace import SessionRules, generate
from kvmesh.replay.simulator import ReplaySimulator

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
DEFAULT_DYNAMO_PYTHON = Path("/tmp/peers/dynamo/bin/python")
# (prefix reuse, TTFT mean, p50, p99) reported by Dynamo 1.6.1's run_trace_replay on the same runs.
DYNAMO = {
    ("round-robin", 4): (0.1105, 653, 407, 4199),
    ("round-robin", 6): (0.0974, 3905, 1505, 19649),
    ("kv", 4): (0.367, None, 72, 1210),
    ("kv", 6): (0.305, None, 308, 1589),
}
# kv as issue 45 measured it: the cost of the request in hand alone, no penalty and no pulls
PLAIN_KV = {"kv_duplicate_penalty": 0.0, "kv_pull_ratio": 0.0}
RUNS = [  # (label, options, the Dynamo figures it sits beside)
    ("round-robin", {"router_mode": "round-robin"}, "round-robin"),
    ("random", {"router_mode": "random"}, None),
    ("power-of-two (SGLang)", {"router_mode": "power-of-two"}, None),
    ("cache-aware (SGLang, defaults)", {"router_mode": "cache-aware"}, None),
    (
        "kv (blocks: Dynamo's formula, no penalty)",
        {"kv_cost": "blocks", "kv_duplicate_penalty": 0.0, "kv_pull_ratio": 0.0},
        "kv",
    ),
    ("kv (ttft: default)", {}, None),
    ("plain kv (no penalty, no pulls)", PLAIN_KV, None),
]


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    kind: str
    rules: SessionRules
    num_blocks: int  # per worker: small enough that the family's prefixes compete for the cache
    speedup: float
    held_out: bool = False  # never looked at while tuning a default


FAMILIES = (
    Family("chat", "chat", SessionRules(sessions=6000, session_rate=8.0, seed=2), 8192, 1.0),
    Family("agent loops", "agent", SessionRules(sessions=500, session_rate=0.6, tenants=12, seed=3), 2048, 1.0),
    Family("tenant mix", "mix", SessionRules(sessions=2500, session_rate=3.0, tenants=16, seed=4), 3072, 0.4),
    Family("chat", "chat", SessionRules(sessions=4000, session_rate=6.0, seed=22), 4096, 1.0, held_out=True),
    Family("agent loops", "agent", SessionRules(sessions=400, session_rate=0.8, tenants=8, seed=21), 2048, 1.0, True),
)
FAMILY_RUNS = (
    ("round-robin", {"router_mode": "round-robin"}),
    ("cache-aware (SGLang)", {"router_mode": "cache-aware"}),
    ("kv (default)", {}),
    ("plain kv (no penalty, no pulls)", PLAIN_KV),
)
# Dynamo's replay, run in its own virtualenv: its kv_router on the same trace and engine shape
DYNAMO_REPLAY = """
import json, sys
from dynamo.replay import run_trace_replay
trace, blocks, speedup = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
engine = {"block_size": 64, "num_gpu_blocks": blocks, "max_num_seqs": 256, "max_num_batched_tokens": 8192}
report = run_trace_replay([trace], extra_engine_args={"engine": engine}, num_workers=8, router_mode="kv_router",
                          arrival_speedup_ratio=speedup, trace_block_size=512)
s = (report if isinstance(report, dict) else report.to_dict())["summary"]
print(json.dumps([s["prefix_cache_reused_ratio"], s["median_ttft_ms"], s["p99_ttft_ms"]]))
"""


def dynamo_replay(python: Path, trace: Path, num_blocks: int, speedup: float) -> tuple[float, float, float] | None:
    """Dynamo 1.6.1's (reuse, TTFT p50, p99) on ``trace``, or None where its virtualenv is absent."""
    if not python.exists():
        return None
    done = subprocess.run(
        [str(python), "-c", DYNAMO_REPLAY, str(trace), str(num_blocks), str(speedup)],
        capture_output=True,
        text=True,
        check=True,
    )
    return tuple(json.loads(done.stdout.strip().splitlines()[-1]))


def family_row(router: str, reuse: float, lru: float, p50: float, p99: float) -> None:
    print(f"{'':<26}{router:<28}{reuse:>8.3f}{reuse / lru:>8.1%}{p50:>10.0f}{p99:>9.0f}")


SMOKE_REQUESTS = 200
DEFAULT_RUN, RIVALS = "kv (default)", ("cache-aware (SGLang)", "plain kv (no penalty, no pulls)")
Figures = tuple[float, float, float]  # prefix reuse, TTFT p50, TTFT p99 (ms)


def replay_family(path: str, num_blocks: int, speedup: float, options: dict[str, Any], seed: int) -> Figures:
    """One replay of a family's trace file (a function of its own: the pool's processes run it)."""
    config = ReplayConfig(num_blocks=num_blocks, arrival_speedup_ratio=speedup, seed=seed, **options)
    summary = summarise(ReplaySimulator(config).run(read_trace(Path(path))))
    return summary["prefix_reuse"], summary["ttft_ms"]["p50"], summary["ttft_ms"]["p99"]


def families(
    dynamo_python: Path,
    results: dict[str, Any],
    smoke: bool = False,
    draws: Sequence[int] = (0,),
    replay_seeds: Sequence[int] = (0,),
    jobs: int = 1,
    cache_replies: bool = False,
) -> None:
    """Every family, at each draw (its rules' seed plus the draw), under every policy: reuse (and its
    share of the fleet-wide LRU bound), TTFT p50, p99, each the mean over ``replay_seeds``; under each
    trace whether the default wins every column (:func:`kvmesh.replay.report.shortfalls`). With
    ``cache_replies`` every replay caches each reply where it was made, and Dynamo's is not run."""
    header = f"{'family':<26}{'router':<28}{'reuse':>8}{'of LRU':>8}{'TTFT p50':>10}{'p99':>9}"
    print(header)
    print("-" * len(header))
    wins = 0
    judged: list[tuple[Figures, list[Figures]]] = []  # the default's figures and its rivals', per trace
    with ProcessPoolExecutor(jobs) as pool:
        for family in FAMILIES:
            for draw in draws:
                rules = dataclasses.replace(family.rules, seed=family.rules.seed + draw)
                label = (
                    f"{family.name}{' (held out)' if family.held_out else ''}{f', seed {rules.seed}' if draw else ''}"
                )
                with tempfile.TemporaryDirectory() as scratch:
                    path = Path(scratch) / "trace.jsonl"
                    if smoke:
                        rules = dataclasses.replace(rules, sessions=max(4, rules.sessions // 100))
                    path.write_text("".join(json.dumps(row) + "\n" for row in generate(family.kind, rules)))
                    trace = read_trace(path)
                    config = ReplayConfig(num_blocks=family.num_blocks)
                    capacity = config.workers * config.num_blocks
                    bounds = reuse_bounds(trace, config.trace_block_size, config.block_size, capacity, cache_replies)
                    lru = bounds.fleet_lru
                    print(
                        f"{label}: {len(trace)} requests; bounds: fleet LRU {lru:.3f}, infinite {bounds.infinite:.3f}"
                    )
                    runs = {
                        (router, seed): pool.submit(
                            replay_family,
                            str(path),
                            family.num_blocks,
                            family.speedup,
                            {**options, "cache_replies": cache_replies},
                            seed,
                        )
                        for router, options in FAMILY_RUNS
                        for seed in replay_seeds
                    }
                    means: dict[str, Figures] = {}
                    for router, _options in FAMILY_RUNS:
                        each = [runs[router, seed].result() for seed in replay_seeds]
                        reuse, p50, p99 = means[router] = tuple(sum(f[i] for f in each) / len(each) for i in range(3))
                        results[f"{label}: {router}"] = {
                            "prefix_reuse": reuse,
                            "ttft_p50": p50,
                            "ttft_p99": p99,
                            "replay_seeds": {seed: figures for seed, figures in zip(replay_seeds, each, strict=True)},
                        }
                        family_row(router, reuse, lru, p50, p99)
                    dynamo = (
                        None if cache_replies else dynamo_replay(dynamo_python, path, family.num_blocks, family.speedup)
                    )
                if dynamo is not None:
                    reuse, p50, p99 = dynamo
                    results[f"{label}: Dynamo 1.6.1 kv_router"] = {
                        "prefix_reuse": reuse,
                        "ttft_p50": p50,
                        "ttft_p99": p99,
                    }
                    family_row("Dynamo 1.6.1 (its replay)", reuse, lru, p50, p99)
                rivals = [means[name] for name in RIVALS]
                short = shortfalls(means[DEFAULT_RUN], rivals)
                judged.append((means[DEFAULT_RUN], rivals))
                wins += not short
                verdict = "yes" if not short else f"no ({', '.join(short)})"
                column, margin = closest_margin(means[DEFAULT_RUN], rivals)
                verdict += f"; closest: {column}, {abs(margin):.1%} {'ahead' if margin >= 0 else 'behind'}"
                if len(replay_seeds) > 1:  # a win on the seeds' mean may be a loss on some seed
                    won = sum(
                        not shortfalls(runs[DEFAULT_RUN, seed].result(), [runs[name, seed].result() for name in RIVALS])
                        for seed in replay_seeds
                    )
                    verdict += f"; won on {won} of {len(replay_seeds)} replay seeds alone"
                results[f"{label}: closest margin"] = {"column": column, "margin": margin}
                print(f"{'':<26}the default at least the best of cache-aware and plain kv in every column: {verdict}")
    seeds = f" (means over replay seeds {', '.join(map(str, replay_seeds))})" if len(replay_seeds) > 1 else ""
    print(f"\nthe default wins every column on {wins} of {len(judged)} traces{seeds}")
    results["default_wins_every_column"] = {"traces": len(judged), "wins": wins}
    pooled = pooled_margins(judged)
    print("the default's margin on the best rival per column, over these traces [95% interval resampling them]:")
    for margin in pooled:
        print(f"  {margin}")
    results["pooled_margins"] = {margin.column: dataclasses.asdict(margin) for margin in pooled}


def fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def tripled(trace: list[TraceRequest]) -> list[TraceRequest]:
    """The trace three times, each copy starting after the previous one ends (12k requests)."""
    span = trace[-1].timestamp_ms + 1
    return [dataclasses.replace(r, timestamp_ms=r.timestamp_ms + k * span) for k in range(3) for r in trace]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--json", type=Path, default=None, help="also write every summary here")
    parser.add_argument("--part", choices=("shared", "families"), default=None, help="one part only (default: both)")
    parser.add_argument("--smoke", action="store_true", help="a smoke-sized run (CI): the figures mean nothing")
    parser.add_argument(
        "--draws",
        type=int,
        nargs="+",
        default=[0],
        help="families: replay each at its rules' seed plus each of these (100: a draw no default was tuned on)",
    )
    parser.add_argument(
        "--replay-seeds", type=int, nargs="+", default=[0], help="families: each figure the mean over these seeds"
    )
    parser.add_argument("--jobs", type=int, default=1, help="families: replays run on this many processes")
    parser.add_argument(
        "--cache-replies",
        action="store_true",
        help="families: cache each turn's reply on the worker that served it (kvmesh replay --cache-replies); "
        "Dynamo's replay, which has no such rule, is then left out",
    )
    parser.add_argument(
        "--dynamo-python",
        type=Path,
        default=DEFAULT_DYNAMO_PYTHON,
        help="the Python of a virtualenv with ai-dynamo 1.6.1, for its replay of the families (skipped if absent)",
    )
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    results: dict[str, Any] = {}
    if args.part != "families":
        shared(args.trace, results, args.smoke)
    if args.part != "shared":
        print()
        families(args.dynamo_python, results, args.smoke, args.draws, args.replay_seeds, args.jobs, args.cache_replies)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


def shared(path: Path, results: dict[str, Any], smoke: bool = False) -> None:
    """Every router mode on the shared trace at speed-ups 4 and 6, Dynamo's figures beside."""
    trace = read_trace(path)
    if smoke:
        trace = trace[:SMOKE_REQUESTS]
    config = ReplayConfig()
    bounds = reuse_bounds(trace, config.trace_block_size, config.block_size, config.workers * config.num_blocks)
    results["reuse_bounds"] = {"fleet_lru": bounds.fleet_lru, "infinite_cache": bounds.infinite}
    print(
        f"the most any router could reuse here: {bounds.fleet_lru:.4f} with one LRU cache as large as the fleet's, "
        f"{bounds.infinite:.4f} with an infinite one\n"
    )
    header = (
        f"{'speed-up':<9}{'router':<32}{'reuse':>8}{'of LRU':>8}{'TTFT mean':>11}{'p50':>8}{'p90':>8}{'p99':>8}"
        f"{'TPOT':>7}{'ITL p99':>9}"
    )
    print(header)
    print("-" * len(header))
    for speedup in (4, 6):
        for label, options, beside in RUNS:
            config = ReplayConfig(arrival_speedup_ratio=speedup, **options)
            started = time.perf_counter()
            summary = summarise(ReplaySimulator(config).run(trace))
            summary["wall_clock_s"] = time.perf_counter() - started
            results[f"{label} x{speedup}"] = summary
            ttft, reuse = summary["ttft_ms"], summary["prefix_reuse"]
            print(
                f"{speedup:<9}{label:<32}{reuse:>8.4f}{reuse / bounds.fleet_lru:>8.1%}"
                f"{ttft['mean']:>11.0f}{ttft['p50']:>8.0f}"
                f"{ttft['p90']:>8.0f}{ttft['p99']:>8.0f}{summary['tpot_ms']['mean']:>7.1f}{summary['itl_ms']['p99']:>9.1f}"
            )
            dynamo = DYNAMO.get((beside, speedup))
            if dynamo is not None:
                reuse, mean, p50, p99 = dynamo
                print(
                    f"{'':<9}{'  Dynamo 1.6.1':<32}{reuse:>8.4f}{reuse / bounds.fleet_lru:>8.1%}{fmt(mean):>11}"
                    f"{p50:>8}{'-':>8}{p99:>8}{'-':>7}{'-':>9}"
                )
    big = tripled(trace)
    started = time.perf_counter()
    summarise(ReplaySimulator(ReplayConfig(router_mode="kv", arrival_speedup_ratio=4)).run(big))
    wall = time.perf_counter() - started
    print(f"\nwall clock of one {len(big)}-request kv replay: {wall:.1f} s")
    results["wall_clock_12k_kv_s"] = wall


if __name__ == "__main__":
    main()
