"""kvmesh next to NVIDIA Dynamo 1.6.1, the SGLang router 0.3.2 and a direct call, on the same load.

Each system serves OpenAI chat on 127.0.0.1 with two mock engines sped up (``--speedup``) so the
engines are not the bottleneck:

- ``kvmesh``: ``kvmesh up --workers 2`` (frontend, router, indexer, NATS, 2 mock workers);
- ``dynamo``: Dynamo's frontend with its KV router and 2 mockers (``/tmp/peers/run_dyn/start.sh``);
- ``sglang``: sglang-router (``cache_aware``) in front of 2 of the peers' minimal HTTP mocks;
- ``direct``: one of those mocks called directly (the floor).

(The layout systems, kvmesh's processes and messages with no work in them, were an investigation
of the serving-CPU push; their findings are in docs/decisions/0019 and docs/perf/history.md.)

Every scenario runs ``../shared/peers/loadgen.py`` (non-streaming chat, 16 shared ~200-word system
prompts, aiohttp with at most ``c`` connections kept alive) and reads the serving processes' CPU
time from ``/proc`` (kvmesh: frontend, router, indexer and NATS; Dynamo: its frontend; SGLang: its
router), so each row gives requests/s, latency p50/p99 and serving CPU per request, and for kvmesh
and Dynamo the engines' CPU per request (kvmesh's workers, Dynamo's mockers). With
``--stream`` the same requests are streamed (``bench.stream_load``) and the time to the first event
is printed too, with the events an answer had and the load generator's own CPU per request (it
shares the cores with the system it measures); only kvmesh and Dynamo run then, since the peers'
minimal mocks behind the SGLang router do not stream. The systems run one after the other, twice
(``--rounds``), and both rounds are printed; each serves ``--warmup`` requests after it starts,
before anything is measured. With ``--interleave`` they all run at once instead and each scenario
goes round them in turn, the order flipped every round: this machine's speed drifts by up to 20%
a minute, and interleaving puts that drift on every system alike rather than between them. Each
system's CPU is read from the processes its own start made. Install the peers as ``../shared/peers/README.md``
says (they live under ``/tmp/peers``).

    python -m bench.peers [--rounds 2 --n 1500 --speedup 100] [--stream] [--interleave]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from bench.processes import cpu_seconds, start_in_session, stop_sessions
from bench.serving_cpu import command_lines
from kvmesh.common.runtime.ports import free_port, process_tree
from kvmesh.devtools.mesh_process import MeshProcess

PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers"
LOADGEN = PEERS / "loadgen.py"
RUN = Path("/tmp/peers")
# (label, max tokens, concurrency, requests as a share of --n)
SCENARIOS = [("8 tokens, c=1", 8, 1, 0.2), ("8 tokens, c=8", 8, 8, 1.0), ("64 tokens, c=8", 64, 8, 0.5)]
SCENARIOS += [("8 tokens, c=32", 8, 32, 1.0)]


def processes_matching(*markers: str) -> list[int]:
    return [
        pid
        for pid, command in command_lines()
        if any(marker in command for marker in markers) and "bench.peers" not in command
    ]


def wait_for(url: str, body: dict, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    while True:
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer within {timeout} s")
        time.sleep(0.5)


class System:
    """One system under test: how to start it, its URL and model, which processes serve."""

    def __init__(self, name: str, model: str, serving: tuple[str, ...], engines: tuple[str, ...] = ()) -> None:
        self.name, self.model, self.serving, self.engines = name, model, serving, engines
        self.url = ""
        self._stop: Callable[[], None] = lambda: None
        # the processes this start made: its serving and engine processes are found below them, so
        # two systems with the same process names can run at once
        self.roots: list[int] = []

    def processes(self, markers: tuple[str, ...]) -> list[int]:
        """This system's processes whose command line holds one of ``markers``."""
        if not markers:
            return []
        mine = process_tree(*self.roots)
        return [pid for pid in processes_matching(*markers) if pid in mine]

    def start(self, speedup: float) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/v1/chat/completions"
        getattr(self, f"_start_{self.name}")(speedup, port)
        wait_for(self.url, {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})

    def stop(self) -> None:
        self._stop()

    def _start_kvmesh(self, speedup: float, port: int) -> None:
        mesh = MeshProcess("--workers", "2", "--speedup-ratio", str(speedup), "--log-level", "warning", http_port=port)
        mesh.start(timeout=120)
        self.roots = [mesh.process.pid]
        self._stop = mesh.stop

    def _start_dynamo(self, speedup: float, port: int) -> None:
        env = {**os.environ, "SPEEDUP": str(speedup), "FE_PORT": str(port), "DYN_LOG": "warn"}
        subprocess.run(["bash", str(RUN / "run_dyn" / "start.sh")], env=env, check=True)
        # start.sh leaves its processes to init and writes their pids
        self.roots = [int((RUN / "run_dyn" / f"{p}.pid").read_text()) for p in ("frontend", "mocker1", "mocker2")]
        self._stop = lambda: subprocess.run(["bash", str(RUN / "run_dyn" / "stop.sh")], check=False)

    def _start_sglang(self, speedup: float, port: int) -> None:
        python = str(RUN / "sgl" / "bin" / "python")
        mocks = [free_port(), free_port()]
        started = [
            self._spawn([python, str(PEERS / "mock_worker.py"), "--port", str(p), "--name", f"w{p}"]) for p in mocks
        ]
        router = [python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
        router += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--policy", "cache_aware"]
        router += ["--log-level", "warn", "--worker-urls", *[f"http://127.0.0.1:{p}" for p in mocks]]
        started.append(self._spawn(router))
        self.roots = [p.pid for p in started]
        self._stop = lambda: stop_sessions(started)

    def _start_direct(self, speedup: float, port: int) -> None:
        python = str(RUN / "sgl" / "bin" / "python")
        started = [self._spawn([python, str(PEERS / "mock_worker.py"), "--port", str(port), "--name", "direct"])]
        self.roots = [p.pid for p in started]
        self._stop = lambda: stop_sessions(started)

    @staticmethod
    def _spawn(argv: list[str]) -> subprocess.Popen[bytes]:
        env = {**os.environ, "HOME": str(RUN / "home")}
        return start_in_session(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


KVMESH_SERVING = ("kvmesh.frontend", "kvmesh.router", "kvmesh.indexer", "nats-server")
STREAMING = ("kvmesh", "dynamo")  # the systems whose engines stream
SYSTEMS = [
    System("kvmesh", "kvmesh-tiny", KVMESH_SERVING, ("kvmesh.worker",)),
    System("dynamo", "tiny", ("dynamo.frontend",), ("dynamo.mocker",)),
    System("sglang", "tiny", ("sglang::router", "sglang_router")),
    System("direct", "tiny", ()),
]
BY_DEFAULT = ("kvmesh", "dynamo", "sglang", "direct")


def run_scenario(system: System, max_tokens: int, concurrency: int, requests: int, stream: bool) -> dict:
    pids, engine_pids = system.processes(system.serving), system.processes(system.engines)
    before, engines_before = cpu_seconds(pids), cpu_seconds(engine_pids)
    load = [sys.executable, "-m", "bench.stream_load"] if stream else [sys.executable, str(LOADGEN)]
    command = [*load, "--url", system.url, "--n", str(requests), "--c", str(concurrency)]
    command += ["--max-tokens", str(max_tokens), "--model", system.model]
    finished = subprocess.run(
        command, capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1]
    )
    report = json.loads(finished.stdout.strip().splitlines()[-1])
    served = max(report["ok"], 1)
    report["cpu_ms"] = (cpu_seconds(pids) - before) * 1000 / served if pids else None
    report["engine_cpu_ms"] = (cpu_seconds(engine_pids) - engines_before) * 1000 / served if engine_pids else None
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--n", type=int, default=1500, help="requests of the largest scenario")
    parser.add_argument("--speedup", type=float, default=100.0)
    parser.add_argument(
        "--warmup",
        type=int,
        default=300,
        help="requests (8 tokens, c=8) each system serves after it starts, before the measured scenarios: "
        "the first run after a start is slower (kvmesh's frontend by 13-24%%, its workers by 55-64%%)",
    )
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=[s.name for s in SYSTEMS],
        default=list(BY_DEFAULT),
        metavar="SYSTEM",
        help=f"which to run, of {', '.join(s.name for s in SYSTEMS)} (default: all)",
    )
    parser.add_argument(
        "--stream",
        action="store_true",
        help="streamed chat (bench.stream_load: the same prompts, time to first token too); kvmesh and "
        "Dynamo only, since the peers' minimal mocks behind the SGLang router do not stream",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="start every system at once and run each scenario on each system in turn, the order "
        "flipped every round, so the machine's drift (up to 20%% a minute here) falls on all of them "
        "alike; by default each system runs all scenarios alone, one system after the other",
    )
    args = parser.parse_args()
    if args.stream:
        args.systems = [name for name in args.systems if name in STREAMING]
    systems = [s for s in SYSTEMS if s.name in args.systems]
    results: dict[tuple[str, str], list[dict]] = {}

    def measure(system: System, label: str, tokens: int, concurrency: int, share: float) -> None:
        report = run_scenario(system, tokens, concurrency, max(50, int(args.n * share)), args.stream)
        results.setdefault((label, system.name), []).append(report)
        print(f"  {system.name:<7} {label:<15} {json.dumps(report)}", flush=True)

    def start(system: System) -> None:
        system.start(args.speedup)
        if args.warmup:  # caches fill and connections open before anything is measured
            run_scenario(system, 8, 8, args.warmup, args.stream)

    if args.interleave:
        with contextlib.ExitStack() as running:
            for system in systems:
                running.callback(system.stop)
                start(system)
            for number in range(args.rounds):
                for label, tokens, concurrency, share in SCENARIOS:
                    for system in systems if number % 2 == 0 else systems[::-1]:
                        measure(system, label, tokens, concurrency, share)
    else:
        for _round in range(args.rounds):
            for system in systems:
                try:
                    start(system)
                    for scenario in SCENARIOS:
                        measure(system, *scenario)
                finally:
                    system.stop()
    names = [s.name for s in systems]
    width = max(22, *(len(n) + 2 for n in names))  # a column per system, wide enough for its name
    print(f"\n{'scenario':<16}{'figure':<16}" + "".join(f"{n:>{width}}" for n in names))
    for label, *_ in SCENARIOS:
        figures = [("requests/s", "rps", 0)]
        if args.stream:
            figures += [("TTFT p50 ms", "ttft_p50_ms", 2), ("TTFT p99 ms", "ttft_p99_ms", 2)]
        figures += [("p50 ms", "p50_ms", 2), ("p99 ms", "p99_ms", 2), ("serving CPU ms", "cpu_ms", 2)]
        figures.append(("engine CPU ms", "engine_cpu_ms", 2))
        if args.stream:
            figures += [("client CPU ms", "client_cpu_ms", 2), ("events/answer", "events_per_answer", 1)]
        for figure, key, digits in figures:
            cells = []
            for name in names:
                values = [r[key] for r in results.get((label, name), []) if r.get(key) is not None]
                cells.append(" / ".join(f"{v:.{digits}f}" for v in values) if values else "-")
            print(f"{label:<16}{figure:<16}" + "".join(f"{c:>{width}}" for c in cells))


if __name__ == "__main__":
    main()
