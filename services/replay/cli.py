"""``kvmesh replay``: replay a Mooncake trace offline, in virtual time, and print a JSON summary."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvmesh.common.logging import configure_logging
from kvmesh.replay.report import summarise, write_csv
from kvmesh.replay.simulator import ReplayConfig, ReplaySimulator
from kvmesh.replay.trace import TraceError, read_trace
from kvmesh.router.scheduler import COST_MODELS

MODES = ("kv", "round-robin", "random")


def build_parser() -> argparse.ArgumentParser:
    defaults = ReplayConfig()
    parser = argparse.ArgumentParser(
        prog="kvmesh replay",
        description=(
            "Replay a request trace (Mooncake JSONL: timestamp ms, input_length, output_length, hash_ids) "
            "through kvmesh's real router, prefix index and mock engine in virtual time; no NATS, no gRPC. "
            "Prints a JSON summary: prefix reuse, TTFT, TPOT, ITL, end-to-end latency, throughput."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("trace", type=Path, help="trace file (JSON lines)")
    parser.add_argument(
        "--trace-block-size", type=int, default=defaults.trace_block_size, help="tokens each hash id stands for"
    )
    parser.add_argument("--workers", type=int, default=defaults.workers, help="simulated workers")
    parser.add_argument("--block-size", type=int, default=defaults.block_size, help="tokens per KV block")
    parser.add_argument(
        "--num-gpu-blocks-override",
        "--num-gpu-blocks",
        dest="num_gpu_blocks",
        type=int,
        default=defaults.num_blocks,
        help="KV blocks per worker",
    )
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs, help="running sequences cap")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=defaults.max_num_batched_tokens,
        help="token budget of one engine step",
    )
    parser.add_argument("--router-mode", choices=MODES, default=defaults.router_mode, help="routing policy")
    parser.add_argument(
        "--kv-cost",
        choices=COST_MODELS,
        default=defaults.kv_cost,
        help="KV cost model: predicted TTFT, or Dynamo's block formula",
    )
    parser.add_argument(
        "--kv-overlap-score-weight",
        type=float,
        default=defaults.overlap_score_weight,
        help="weight of prefill work in the KV cost",
    )
    parser.add_argument(
        "--router-temperature",
        type=float,
        default=defaults.router_temperature,
        help="softmax temperature (0: cheapest worker)",
    )
    parser.add_argument(
        "--arrival-speedup-ratio",
        type=float,
        default=defaults.arrival_speedup_ratio,
        help="divide trace timestamps by this (higher = heavier load)",
    )
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of tie-breaking and sampling")
    disagg = parser.add_argument_group("prefill/decode disaggregation")
    disagg.add_argument(
        "--prefill-workers",
        type=int,
        default=defaults.prefill_workers,
        help="prefill workers besides --workers (which then decode); 0: every worker is aggregated",
    )
    disagg.add_argument(
        "--disagg-min-uncached-tokens",
        type=int,
        default=defaults.disagg_min_uncached_tokens,
        help="prefill on the decode worker when it lacks fewer prompt tokens than this",
    )
    disagg.add_argument(
        "--prefill-queue-limit-tokens",
        type=int,
        default=defaults.prefill_queue_limit_tokens,
        help="a prefill worker with more queued prefill tokens has no capacity",
    )
    disagg.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=defaults.kv_bytes_per_token,
        help="KV bytes per token of the modelled model (transfer size)",
    )
    disagg.add_argument(
        "--kv-transfer-gbps", type=float, default=defaults.kv_transfer_gbps, help="KV transfer bandwidth, GB/s"
    )
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--csv", type=Path, default=None, help="also write one CSV row per request here")
    parser.add_argument("--output", type=Path, default=None, help="write the JSON summary here too")
    return parser


def config_from_args(args: argparse.Namespace) -> ReplayConfig:
    return ReplayConfig(
        workers=args.workers,
        block_size=args.block_size,
        num_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        router_mode=args.router_mode,
        kv_cost=args.kv_cost,
        overlap_score_weight=args.kv_overlap_score_weight,
        router_temperature=args.router_temperature,
        arrival_speedup_ratio=args.arrival_speedup_ratio,
        trace_block_size=args.trace_block_size,
        seed=args.seed,
        prefill_workers=args.prefill_workers,
        disagg_min_uncached_tokens=args.disagg_min_uncached_tokens,
        prefill_queue_limit_tokens=args.prefill_queue_limit_tokens,
        kv_bytes_per_token=args.kv_bytes_per_token,
        kv_transfer_gbps=args.kv_transfer_gbps,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging("warning", service="replay")  # results go to stdout, logs to stderr
    for name in (
        "workers",
        "block_size",
        "num_gpu_blocks",
        "max_num_seqs",
        "max_num_batched_tokens",
        "trace_block_size",
    ):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.arrival_speedup_ratio <= 0:
        parser.error("--arrival-speedup-ratio must be positive")
    if args.prefill_workers < 0 or args.disagg_min_uncached_tokens < 0:
        parser.error("--prefill-workers and --disagg-min-uncached-tokens must be >= 0")
    if args.kv_bytes_per_token <= 0 or args.kv_transfer_gbps <= 0 or args.prefill_queue_limit_tokens <= 0:
        parser.error("--kv-bytes-per-token, --kv-transfer-gbps and --prefill-queue-limit-tokens must be positive")
    if not args.trace.is_file():
        parser.error(f"trace file {args.trace} not found")
    try:
        trace = read_trace(args.trace)
    except TraceError as exc:
        parser.error(str(exc))
    if args.limit is not None:
        trace = trace[: args.limit]
    config = config_from_args(args)
    started = time.perf_counter()
    try:
        records = ReplaySimulator(config).run(trace)
    except TraceError as exc:
        parser.error(str(exc))
    summary = {
        "config": dataclasses.asdict(config),
        **summarise(records),
        "wall_clock_s": time.perf_counter() - started,
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    if args.csv:
        write_csv(records, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
