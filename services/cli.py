"""The ``kvmesh`` command: one entry point for every service and tool."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from kvmesh.common.rpc.grpc_io import choose_grpc_io

COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("kvmesh.up", "start a whole mesh on this machine (NATS, indexer, router, workers, frontend)"),
    "frontend": ("kvmesh.frontend.server", "run the OpenAI-compatible HTTP facade"),
    "router": ("kvmesh.router.server", "run a router replica"),
    "indexer": ("kvmesh.indexer.server", "run an indexer replica"),
    "worker": ("kvmesh.worker.server", "run an inference worker"),
    "inspect": ("kvmesh.inspector", "show what indexer replicas or workers hold (via discovery)"),
    "replay": ("kvmesh.replay.cli", "replay a request trace offline in virtual time (routing quality)"),
    "profile": ("kvmesh.profiler.cli", "measure an engine's prefill and decode times into a profile for the planner"),
    "planner": ("kvmesh.planner.cli", "the SLA planner: `kvmesh planner history` prints its recent decisions"),
    "bench": ("kvmesh.loadgen.cli", "load an OpenAI-compatible endpoint and report latency, throughput, cache hits"),
    "gen-protos": ("kvmesh.devtools.protogen", "regenerate the Python gRPC code from protos/"),
    "build-tiny-model": (
        "kvmesh.worker.engines.vllm.tiny_llama",
        "build the random-weight kvmesh-tiny Llama for `kvmesh worker --engine vllm --model DIR`",
    ),
}


def usage() -> str:
    lines = ["usage: kvmesh <command> [options]", "", "commands:"]
    lines += [f"  {name:<12} {summary}" for name, (_module, summary) in COMMANDS.items()]
    lines += ["", "Run `kvmesh <command> --help` for a command's options."]
    lines += [
        "",
        "environment (every service):",
        "  KVMESH_EVENT_LOOP=asyncio      the standard library's event loop instead of uvloop",
        "  KVMESH_GRPC_IO=event-engine    gRPC core's default I/O layer instead of iomgr (docs/decisions/0025)",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0 if args else 2)
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"kvmesh: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        sys.exit(2)
    # before any service module imports gRPC, which reads its I/O choice once (decision 25)
    choose_grpc_io()
    module = importlib.import_module(COMMANDS[name][0])
    result = module.main(rest)
    if isinstance(result, int):
        sys.exit(result)
