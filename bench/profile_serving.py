"""Where the serving path's CPU goes: py-spy flame graphs of the frontend, router and a worker under load.

Starts ``kvmesh up --workers 2`` (mock engines sped up so the engine is not the bottleneck), drives it
with ``../shared/peers/loadgen.py`` (chat, connections kept alive) and, meanwhile, samples each
service with py-spy (``pip install py-spy``; it reads the processes' stacks from outside, so it
changes nothing in them). Writes an SVG flame graph and the collapsed stacks per service to
``--output``, and prints per service the functions with the most samples of their own (self time)
and the subsystems (gRPC, protobuf, asyncio, HTTP, tokenizer, JSON, logging, kvmesh) summed.

    python -m bench.profile_serving [--py-spy /tmp/pyspy/bin/py-spy --seconds 20 --c 8 --max-tokens 64]
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import time
from pathlib import Path

from bench.serving_cpu import command_lines
from kvmesh.common.ports import free_port
from kvmesh.up import MeshProcess

LOADGEN = Path(__file__).resolve().parents[1].parent / "shared" / "peers" / "loadgen.py"
SERVICES = ("frontend", "router", "worker", "indexer")
# where a frame's file says it belongs (first match wins)
SUBSYSTEMS = (
    ("grpc", "grpc"),
    ("protobuf", "protobuf"),
    ("tokenizer", "tokenizers"),
    ("http", "uvicorn"),
    ("http", "starlette"),
    ("http", "fastapi"),
    ("http", "httptools"),
    ("http", "h11"),
    ("validation", "pydantic"),
    ("json", "json"),
    ("logging", "structlog"),
    ("logging", "logging"),
    ("nats", "nats"),
    ("asyncio", "asyncio"),
    ("kvmesh", "kvmesh"),
)


def pids_of(service: str) -> list[int]:
    return sorted(pid for pid, command in command_lines() if f"-m kvmesh.{service} " in command)


def subsystem(frame: str) -> str:
    for name, marker in SUBSYSTEMS:
        if marker in frame:
            return name
    return "other"


def summarise(collapsed: Path, top: int) -> None:
    own: collections.Counter[str] = collections.Counter()
    by_subsystem: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        samples = int(count)
        leaf = stack.split(";")[-1]
        own[leaf] += samples
        by_subsystem[subsystem(leaf)] += samples
        total += samples
    if not total:
        print("  no samples")
        return
    print("  by subsystem (self time): " + ", ".join(f"{k} {v / total:.0%}" for k, v in by_subsystem.most_common()))
    for frame, samples in own.most_common(top):
        print(f"  {samples / total:6.1%}  {frame}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--py-spy", default="py-spy", help="the py-spy executable")
    parser.add_argument("--seconds", type=int, default=20, help="sampling time per service (all at once)")
    parser.add_argument("--c", type=int, default=8, help="load concurrency")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--speedup-ratio", type=float, default=100.0)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--native", action="store_true", help="also sample C frames (gRPC core, protobuf, tokenizers)")
    parser.add_argument("--output", type=Path, default=Path("bench/out/profile"))
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    port = free_port()
    mesh = MeshProcess(
        "--workers", "2", "--speedup-ratio", str(args.speedup_ratio), "--log-level", "warning", http_port=port
    )
    mesh.start(timeout=120)
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        command = [sys.executable, str(LOADGEN), "--url", url, "--n", "1000000", "--c", str(args.c)]
        command += [
            "--max-tokens",
            str(args.max_tokens),
            "--model",
            "kvmesh-tiny",
            "--max-seconds",
            str(args.seconds + 8),
        ]
        load = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        time.sleep(5)  # past the warm-up
        samplers = {}
        for service in SERVICES:
            pids = pids_of(service)
            if not pids:
                continue
            base = args.output / service
            for suffix in (".txt", ".svg"):  # never summarise an earlier run's file
                base.with_suffix(suffix).unlink(missing_ok=True)
            record = [args.py_spy, "record", "--pid", str(pids[0]), "--duration", str(args.seconds), "--rate", "200"]
            # only the thread holding the GIL (CPU spent in Python and in what Python calls), with C frames
            # (C frames need py-spy to pause the process for each sample: --native costs it some speed)
            record += ["--gil", *(["--native"] if args.native else ["--nonblocking"])]
            samplers[service] = [
                subprocess.Popen(
                    [*record, "--format", fmt, "--output", str(base.with_suffix(suffix))],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for fmt, suffix in (("raw", ".txt"), ("flamegraph", ".svg"))
            ]
        for processes in samplers.values():
            for process in processes:
                process.wait()
        report = load.communicate(timeout=60)[0].strip().splitlines()  # it stops at its --max-seconds
        print(f"load: {report[-1] if report else 'no report'}")
        for service in samplers:
            collapsed = (args.output / service).with_suffix(".txt")
            print(f"\n{service} (flame graph: {args.output / service}.svg)")
            if collapsed.exists():
                summarise(collapsed, args.top)
            else:
                print("  py-spy wrote nothing (is it allowed to read other processes? try as root)")
    finally:
        mesh.stop()


if __name__ == "__main__":
    main()
