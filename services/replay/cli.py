"""``kvmesh replay``: replay a Mooncake trace offline, in virtual time, and print a JSON summary."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.common.core.engine_profile import EngineProfile, ProfileError
from kvmesh.common.runtime.config import build_parser, option, parse_config
from kvmesh.common.runtime.structured_logging import configure_logging
from kvmesh.planner.planner import Planner
from kvmesh.planner.state import PlannerState
from kvmesh.profiler.mock import profile_mock_engine
from kvmesh.replay.bounds import reuse_bounds
from kvmesh.replay.config import ReplayConfig
from kvmesh.replay.mooncake_trace import TraceError, read_trace
from kvmesh.replay.report import forecast_errors, plot_timeline, sla_attainment, summarise, write_csv
from kvmesh.replay.simulator import ReplaySimulator

DESCRIPTION = (
    "Replay a request trace (Mooncake JSONL: timestamp ms, input_length, output_length, hash_ids) "
    "through kvmesh's real router, prefix index and mock engine in virtual time; no NATS, no gRPC. "
    "Prints a JSON summary: prefix reuse (and the most any router could reuse: reuse_bounds; pulled_share: the "
    "part of it pulled from another worker, --kv-pull-ratio), TTFT, TPOT, ITL, end-to-end latency, throughput."
)


@dataclass
class ReplayArgs(ReplayConfig):
    """``kvmesh replay``'s command line: the replay's configuration plus what to read and write."""

    trace: Path = option(None, "trace file (JSON lines)", positional=True)
    limit: int | None = option(None, "replay only the first N requests")
    csv: Path | None = option(None, "also write one CSV row per request here")
    output: Path | None = option(None, "write the JSON summary here too")
    engine_profile: Path | None = option(
        None, "planner: engine profile from `kvmesh profile` (default: measured from the replay's mock engine)"
    )
    plot: Path | None = option(None, "planner: write the pool sizes and request rate over time as a PNG here")
    state_db: Path | None = option(None, "planner: record every step in this SQLite file (`kvmesh planner history`)")
    reuse_bounds: bool = option(
        True,
        "beside the reuse, the most any router could reuse: with one LRU cache as large as the fleet's (device "
        "and host tiers) and with an infinite one (--no-reuse-bounds skips their pass over the trace, about a "
        "second per thousand requests)",
    )

    def replay_config(self) -> ReplayConfig:
        return ReplayConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ReplayConfig)})


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_config(ReplayArgs, argv, prog="kvmesh replay", description=DESCRIPTION)
    parser = build_parser(ReplayArgs, "kvmesh replay", DESCRIPTION)  # for its error(): usage, then exit 2
    configure_logging("warning", service="replay")  # results go to stdout, logs to stderr
    if not args.trace.is_file():
        parser.error(f"trace file {args.trace} not found")
    try:
        trace = read_trace(args.trace)
    except TraceError as exc:
        parser.error(str(exc))
    if args.limit is not None:
        trace = trace[: args.limit]
    config = args.replay_config()
    started = time.perf_counter()
    simulator = ReplaySimulator(config)
    if config.planner:
        try:
            profile = EngineProfile.load(args.engine_profile) if args.engine_profile else None
        except ProfileError as exc:
            parser.error(str(exc))
        profile = profile or profile_mock_engine(simulator.engine_config)
        simulator.attach_planner(Planner(config, profile, disaggregated=config.prefill_workers > 0))
    try:
        records = simulator.run(trace)
    except TraceError as exc:
        parser.error(str(exc))
    summary = {"config": dataclasses.asdict(config), **summarise(records)}
    if args.reuse_bounds:
        capacity = (config.workers + config.prefill_workers) * (config.num_blocks + config.host_kv_blocks)
        bounds = reuse_bounds(trace, config.trace_block_size, config.block_size, capacity, config.cache_replies)
        summary["reuse_bounds"] = bounds.as_dict(summary["prefix_reuse"])
    if config.cache_replies:
        summary["reply_blocks_cached"] = simulator.replies_cached
    summary |= {**fleet_summary(simulator, records, config), "wall_clock_s": time.perf_counter() - started}
    text = json.dumps(summary, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    if args.csv:
        write_csv(records, args.csv)
    if args.state_db:
        if not config.planner:
            parser.error("--state-db records the planner's steps: add --planner")
        asyncio.run(record_steps(args.state_db, simulator.steps))
    if args.plot:
        if simulator.fleet is None:
            parser.error("--plot draws the planner's timeline: add --planner")
        plot_timeline(simulator.fleet.timeline, args.plot, f"planner ({config.load_predictor}) on {args.trace.name}")
    return 0


async def record_steps(path: Path, steps: list) -> None:
    async with PlannerState(path) as state:
        for observation, decision in steps:
            await state.record(observation, decision)


def fleet_summary(simulator: ReplaySimulator, records: list, config: ReplayConfig) -> dict[str, Any]:
    """SLA attainment and what the fleet cost (worker-seconds); with the planner, its timeline."""
    end_ms = max((r.last_token_ms for r in records), default=0.0)
    fleet = simulator.fleet
    worker_seconds = fleet.worker_seconds(end_ms) if fleet else len(simulator.engines) * end_ms / 1000.0
    summary: dict[str, Any] = {
        "sla": {
            "ttft_target_ms": config.ttft_target_ms,
            "itl_target_ms": config.itl_target_ms,
            "sla_attainment": sla_attainment(records, config.ttft_target_ms, config.itl_target_ms),
        },
        "worker_seconds": worker_seconds,
    }
    if fleet is not None:
        sizes = [point["workers"] for point in fleet.timeline]
        summary["planner"] = {
            "decisions": len(simulator.decisions),
            "workers_started": len(fleet.workers),
            "pool_size": {"min": min(sizes, default=0), "max": max(sizes, default=0)},
            "timeline": fleet.timeline,
            "growth_looks": simulator.looks,
        }
        error, rising, falling = forecast_errors(fleet.timeline)
        summary["planner"]["rate_forecast"] = {"mean_error": error, "bias_rising": rising, "bias_falling": falling}
    return summary


if __name__ == "__main__":
    sys.exit(main())
