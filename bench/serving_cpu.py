"""Requests per second and CPU per request of each serving process, under one load.

Runs ``../shared/peers/loadgen.py`` (bounded async load, non-streaming chat, at most ``--c``
connections kept alive), or with ``--stream`` the same requests streamed (``bench.stream_load``),
against a running mesh and reads every kvmesh service's and the NATS server's CPU time from
``/proc`` before and after, so the CPU each one spent per request is printed beside the rate.

    kvmesh up --workers 2 --speedup-ratio 100 --http-port 18100 &
    python -m bench.serving_cpu --url http://127.0.0.1:18100/v1/chat/completions --n 2000 --c 32 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from bench.processes import cpu_seconds
from bench.stream_load import add_load_arguments
from kvmesh.common.runtime.ports import process_tree

LOADGEN = Path(__file__).resolve().parents[1].parent / "shared" / "peers" / "loadgen.py"
SERVICES = ("kvmesh.frontend", "kvmesh.router", "kvmesh.indexer", "kvmesh.worker", "nats-server")


def command_lines() -> Iterator[tuple[int, str]]:
    """(pid, command line) of every process on this machine that can still be read."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue  # it exited
            yield int(entry), command


def service_pids(root: int | None = None) -> dict[str, list[int]]:
    """The kvmesh service processes (and NATS servers), by service: this machine's, or only those
    below the process ``root`` (one ``kvmesh up`` of several)."""
    found: dict[str, list[int]] = {}
    mine = process_tree(root) if root is not None else None
    for pid, command in command_lines():
        if mine is not None and pid not in mine:
            continue
        for service in SERVICES:
            if service in command and "bench.serving_cpu" not in command:
                found.setdefault(service.removeprefix("kvmesh."), []).append(pid)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_load_arguments(parser)
    parser.add_argument(
        "--stream", action="store_true", help="streamed chat (bench.stream_load) instead of whole answers"
    )
    parser.add_argument(
        "--root-pid",
        type=int,
        help="count only the processes below this one (the `kvmesh up` of this mesh, when several run)",
    )
    args = parser.parse_args()
    if args.stream:
        command = [sys.executable, "-m", "bench.stream_load"]
    elif LOADGEN.exists():
        command = [sys.executable, str(LOADGEN)]
    else:
        raise SystemExit(f"{LOADGEN} not found: this bench needs ../shared/peers beside the checkout")
    command += ["--url", args.url, "--n", str(args.n), "--c", str(args.c)]
    command += ["--max-tokens", str(args.max_tokens), "--model", args.model]
    pids = service_pids(args.root_pid)
    before = {service: cpu_seconds(p) for service, p in pids.items()}
    finished = subprocess.run(
        command, capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1]
    )
    after = {service: cpu_seconds(p) for service, p in pids.items()}
    report = json.loads(finished.stdout.strip().splitlines()[-1])
    served = max(report["ok"], 1)
    per_request = {s: round((after[s] - before[s]) * 1000 / served, 2) for s in pids}
    serving = sum(per_request.get(s, 0.0) for s in ("frontend", "router", "indexer"))
    figures = {
        "ok": report["ok"],
        "errors": report["errors"],
        "requests_per_s": round(report["ok"] / report["wall_s"], 1),
        "p50_ms": report.get("p50_ms"),
        "cpu_ms_per_request": per_request,
        "serving_cpu_ms_per_request": round(serving, 2),
    }
    if "events_per_answer" in report:  # streamed: how many SSE events an answer took
        figures["events_per_answer"] = report["events_per_answer"]
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
