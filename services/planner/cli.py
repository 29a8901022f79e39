"""``kvmesh planner run|history``: the planner service, and its recent decisions from its state file."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvmesh.common.runtime.run_file import default_namespace, read_run_record
from kvmesh.planner.state import PlannerState, StoredStep

DEFAULT_STATE_DB = Path("kvmesh-planner.sqlite")


def when(at_s: float) -> str:
    """Simulated seconds as they are; wall-clock time (a live planner's) as UTC time of day."""
    if at_s < 1e9:
        return f"{at_s:.1f}"
    return time.strftime("%H:%M:%S", time.gmtime(at_s))


def render(steps: list[StoredStep]) -> str:
    if not steps:
        return "no decisions recorded yet"
    header = (
        f"{'at':>9} {'rate':>6} {'→ pred':>7} {'ISL':>6} {'hit':>5} {'TTFT p90':>9} {'ITL p90':>8} "
        f"{'SLA':>5} {'window':>6} {'pools now':>10} {'wanted':>8} {'set':>8} {'cap':>5}"
    )
    lines = [header]
    for step in steps:
        o, d = step.observation, step.decision

        def pools(p) -> str:
            return str(p.aggregated) if not (p.prefill or p.decode) else f"{p.prefill}P+{p.decode}D"

        attained = "-" if o.sla_attainment is None else f"{o.sla_attainment:.2f}"
        window = "-" if d.window_attainment is None else f"{d.window_attainment:.3f}"
        lines.append(
            f"{when(d.at_s):>9} {o.request_rate:6.2f} {d.forecast.request_rate:7.2f} {o.mean_input_tokens:6.0f} "
            f"{o.prefix_hit_fraction:5.2f} {o.ttft_p90_ms:9.0f} {o.itl_p90_ms:8.1f} {attained:>5} {window:>6} "
            f"{pools(d.current):>10} {pools(d.wanted):>8} {pools(d.target):>8} {d.utilisation_cap:5.2f}"
        )
    return "\n".join(lines)


async def read_history(path: Path, limit: int) -> list[StoredStep]:
    async with PlannerState(path) as state:
        return await state.recent(limit)


async def read_shared_history(nats_url: str | None, namespace: str, limit: int) -> list[StoredStep]:
    """The namespace's steps from the JetStream stream (``--state-store nats``)."""
    from kvmesh.common.runtime.process import connect_nats
    from kvmesh.common.runtime.run_file import resolve_nats_url
    from kvmesh.planner.step_stream import JetStreamSteps

    url, _source = resolve_nats_url(nats_url, namespace)
    nc = await connect_nats(url, name="kvmesh-planner-history")
    try:
        async with JetStreamSteps(nc, namespace) as state:
            return await state.recent(limit)
    finally:
        await nc.close()


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["run"]:
        from kvmesh.common.runtime.service import service_main
        from kvmesh.planner.service import PlannerConfig, serve

        service_main(
            PlannerConfig,
            args_list[1:],
            service="planner",
            description=(
                "Run the SLA planner: every --adjustment-interval it merges the frontends' load reports, predicts "
                "the next interval's load, sizes the worker pool from the engine profile to meet --ttft-target-ms "
                "and --itl-target-ms, records the step in --state-store and resizes the fleet through --connector."
            ),
            serve=serve,
        )
        return 0
    parser = argparse.ArgumentParser(
        prog="kvmesh planner",
        description=(
            "The SLA planner. `run` runs it (see `kvmesh planner run --help`); `history` prints its recent "
            "decisions from its state (its SQLite file, or the namespace's JetStream stream)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("run", help="run the planner service (options: kvmesh planner run --help)", add_help=False)
    history = commands.add_parser(
        "history", help="print the recent decisions", description="Print the planner's recent decisions."
    )
    history.add_argument(
        "--state-store",
        choices=("sqlite", "nats"),
        default="sqlite",
        help="where the planner keeps its steps, as given to `kvmesh planner run --state-store`",
    )
    history.add_argument(
        "--nats-url",
        default=None,
        help="--state-store nats: the NATS server (default: that of the running `kvmesh up` of the namespace, else "
        "nats://127.0.0.1:4222; credentials from the KVMESH_NATS_* environment)",
    )
    history.add_argument(
        "--state-db",
        type=Path,
        default=None,
        help=f"the planner's SQLite state file (default: that of the running `kvmesh up --planner`, else "
        f"{DEFAULT_STATE_DB})",
    )
    history.add_argument("--namespace", default=default_namespace(), help="mesh namespace [env KVMESH_NAMESPACE]")
    history.add_argument("--limit", type=int, default=20, help="how many decisions")
    history.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(args_list)
    if args.state_store == "nats":
        steps = asyncio.run(read_shared_history(args.nats_url, args.namespace, args.limit))
        print_history(steps, args.json)
        return 0
    if args.state_db is None:
        running = read_run_record(args.namespace)
        recorded = running.planner_state_db if running is not None else None
        args.state_db = Path(recorded) if recorded else DEFAULT_STATE_DB
    if not args.state_db.is_file():
        parser.error(f"no planner state at {args.state_db}")
    steps = asyncio.run(read_history(args.state_db, args.limit))
    print_history(steps, args.json)
    return 0


def print_history(steps: list[StoredStep], as_json: bool) -> None:
    if as_json:
        print(json.dumps([step.to_dict() for step in steps], indent=2))
    else:
        print(render(steps))


if __name__ == "__main__":
    sys.exit(main())
