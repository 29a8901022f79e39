"""``kvmesh replay``: replay a Mooncake trace offline, in virtual time, and print a JSON summary."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvmesh.common.config import build_parser, option, parse_config
from kvmesh.common.structured_logging import configure_logging
from kvmesh.replay.mooncake_trace import TraceError, read_trace
from kvmesh.replay.report import summarise, write_csv
from kvmesh.replay.simulator import ReplayConfig, ReplaySimulator

DESCRIPTION = (
    "Replay a request trace (Mooncake JSONL: timestamp ms, input_length, output_length, hash_ids) "
    "through kvmesh's real router, prefix index and mock engine in virtual time; no NATS, no gRPC. "
    "Prints a JSON summary: prefix reuse, TTFT, TPOT, ITL, end-to-end latency, throughput."
)


@dataclass
class ReplayArgs(ReplayConfig):
    """``kvmesh replay``'s command line: the replay's configuration plus what to read and write."""

    trace: Path = option(None, "trace file (JSON lines)", positional=True)
    limit: int | None = option(None, "replay only the first N requests")
    csv: Path | None = option(None, "also write one CSV row per request here")
    output: Path | None = option(None, "write the JSON summary here too")

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
