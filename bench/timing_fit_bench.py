"""Does the router's learned timing model route as well as the exact one? (``kvmesh replay``, virtual time)

The ``ttft`` cost predicts each worker's time to first token with a step-time model. For the mock
engine the router knows it exactly; for a real engine it must be learned. Setups on the shared
trace (8 workers, Dynamo's mocker shape):

- a homogeneous fleet, and one where 4 of the 8 workers are 2x slower;
- the router's prior: exact (it knows each worker's true model), or the nominal model scaled by
  0.5, 1 or 2 — used as it is (``prior``) or as the start of a fit from each worker's steps
  (``learned``).

Printed: prefix reuse and TTFT mean / p50 / p99, and for each learned setup its TTFT mean and p99 as
a ratio of the exact model's.

    python -m bench.timing_fit_bench [--limit 4000] [--arrival-speedup-ratio 4]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvmesh.replay.config import ReplayConfig
from kvmesh.replay.mooncake_trace import read_trace
from kvmesh.replay.report import summarise
from kvmesh.replay.simulator import ReplaySimulator

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


def run(trace: list, speedup: float, **options: object) -> dict:
    config = ReplayConfig(arrival_speedup_ratio=speedup, **options)
    return summarise(ReplaySimulator(config).run(trace))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--arrival-speedup-ratio", type=float, default=4.0)
    args = parser.parse_args()
    trace = read_trace(args.trace)[: args.limit]
    print(f"{len(trace)} requests, speed-up {args.arrival_speedup_ratio}, 8 workers")
    print(
        f"{'fleet':12} {'router timing':22} {'reuse':>7} {'TTFT mean':>10} {'p50':>8} {'p99':>8}  vs exact (mean, p99)"
    )
    for fleet, slow in (("homogeneous", 0), ("4 of 8 slow", 4)):
        exact = run(trace, args.arrival_speedup_ratio, slow_workers=slow, router_timing="exact")
        rows = [("exact", exact)]
        for scale in (0.5, 1.0, 2.0):
            for timing in ("prior", "learned"):
                summary = run(
                    trace,
                    args.arrival_speedup_ratio,
                    slow_workers=slow,
                    router_timing=timing,
                    router_prefill_scale=scale,
                    router_decode_scale=scale,
                )
                rows.append((f"{timing} from x{scale:g}", summary))
        for label, summary in rows:
            ttft = summary["ttft_ms"]
            ratio = f"{ttft['mean'] / exact['ttft_ms']['mean']:.3f}, {ttft['p99'] / exact['ttft_ms']['p99']:.3f}"
            print(
                f"{fleet:12} {label:22} {summary['prefix_reuse']:7.4f} {ttft['mean']:10.1f} {ttft['p50']:8.1f} "
                f"{ttft['p99']:8.1f}  {ratio}"
            )


if __name__ == "__main__":
    main()
