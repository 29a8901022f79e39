"""Routing quality on the Mooncake synthetic trace: our replay next to NVIDIA Dynamo 1.6.1's figures.

Runs ``kvmesh replay``'s simulator for every router mode — round-robin, random, SGLang's
power-of-two and cache-aware, and kv (our default predicted-TTFT cost, and Dynamo's block
formula) — at arrival speed-ups 4 (moderate) and 6 (heavy), with Dynamo's mocker
configuration (8 workers, 64-token blocks, 16,384 blocks, 256 sequences, 8,192 batched tokens),
prints one table, then times a 12,000-request replay (the trace three times over, back to back).

    python -m bench.replay_report [--trace ../shared/data/mooncake_synthetic_trace.jsonl]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from kvmesh.replay.bounds import reuse_bounds
from kvmesh.replay.config import ReplayConfig
from kvmesh.replay.mooncake_trace import TraceRequest, read_trace
from kvmesh.replay.report import summarise
from kvmesh.replay.simulator import ReplaySimulator

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
# (prefix reuse, TTFT mean, p50, p99) reported by Dynamo 1.6.1's run_trace_replay on the same runs.
DYNAMO = {
    ("round-robin", 4): (0.1105, 653, 407, 4199),
    ("round-robin", 6): (0.0974, 3905, 1505, 19649),
    ("kv", 4): (0.367, None, 72, 1210),
    ("kv", 6): (0.305, None, 308, 1589),
}
RUNS = [
    ("round-robin", "round-robin", "ttft"),
    ("random", "random", "ttft"),
    ("power-of-two (SGLang)", "power-of-two", "ttft"),
    ("cache-aware (SGLang, defaults)", "cache-aware", "ttft"),
    ("kv (blocks: Dynamo's formula)", "kv", "blocks"),
    ("kv (ttft: default)", "kv", "ttft"),
]


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
    args = parser.parse_args()
    trace = read_trace(args.trace)
    results = {}
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
        for label, mode, cost in RUNS:
            config = ReplayConfig(router_mode=mode, kv_cost=cost, arrival_speedup_ratio=speedup)
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
            dynamo = DYNAMO.get((mode, speedup)) if label != "kv (ttft: default)" else None
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
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
