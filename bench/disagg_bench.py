"""Disaggregation figures: KV transfer bandwidth (NIXL against TCP), and serving a Mooncake trace at
a fixed rate with 1 prefill + 2 decode workers against 3 aggregated workers.

Transfer: a separate process holds 64 MiB of KV blocks behind a ``KvTransferServer``; this process
pulls them all into its own buffer with ``KvTransferClient``, over each backend, several times.
Printed: seconds and GB/s for the move alone, and with the byte-for-byte verification a decode
worker does.

Serving: ``kvmesh up`` (mock workers at ``--speedup-ratio``) loaded by ``kvmesh bench`` with the
first ``--limit`` requests of the trace at ``--request-rate`` requests/s; TTFT, inter-token
latency, throughput, and where the prefills ran (the router's metrics).

Replay: the same comparison in virtual time through ``kvmesh replay``'s simulator (the router's own
pipeline and the mock engine, no processes): 3 aggregated vs 1 prefill + 2 decode, and 6 vs 2 + 4,
each split fleet under ``--disagg-split-when always`` and ``gain``, on the whole trace.

    python -m bench.disagg_bench [--part transfer|serving|replay|all] [--limit 120] [--request-rate 2]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.live_load import run_load
from kvmesh.devtools.mesh_process import MeshProcess
from kvmesh.worker.kv_transfer.kv_buffer import KvBuffer
from kvmesh.worker.kv_transfer.nixl_agent import NixlAgent, nixl_available
from kvmesh.worker.kv_transfer.transport import KvTransferClient, KvTransferServer
from tests.support import discovered, scrape

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
BLOCK_BYTES = 256 << 10  # 256 KiB blocks: 64 MiB is 256 of them
TOTAL_BYTES = 64 << 20
ROOMS = 64


# ---- transfer bandwidth --------------------------------------------------------------------------
async def serve_rooms(backend: str, port_file: str) -> None:
    """The prefill side: 64 MiB of blocks, each slot filled with its index + 1, offered in many rooms."""
    kv = KvBuffer(TOTAL_BYTES // BLOCK_BYTES, BLOCK_BYTES)
    for slot in range(kv.num_blocks):
        kv.fill(slot, slot + 1)
    nixl = NixlAgent("bench-prefill", kv) if backend == "nixl" else None
    server = KvTransferServer(kv, lambda _request_id: None, 3600.0, nixl)
    await server.start("127.0.0.1")
    for room in range(ROOMS):
        server.ready(room, f"r{room}", list(range(kv.num_blocks)))
    Path(port_file).write_text(str(server.port))
    await asyncio.Event().wait()


async def pull_rounds(backend: str, port: int, rounds: int, verify: bool, first_room: int) -> list[float]:
    kv = KvBuffer(TOTAL_BYTES // BLOCK_BYTES, BLOCK_BYTES)
    kv.data[:] = 0  # touch the pages first, as a running worker's buffer would be
    nixl = NixlAgent(f"bench-decode-{verify}", kv) if backend == "nixl" else None
    client = KvTransferClient(kv, nixl)
    slots = list(range(kv.num_blocks))
    contents = [s + 1 for s in slots]
    seconds = []
    for i in range(rounds):
        kv.data[:] = 0
        result = await client.pull("127.0.0.1", port, first_room + i, 0, slots, contents, 30.0, verify=verify)
        assert result.backend == backend, result
        seconds.append(result.seconds)
    if not verify:  # the bytes must have arrived all the same
        assert all(kv.holds(s, c) for s, c in zip(slots, contents, strict=True))
    return seconds


# the split itself is measured: every request that may split does (not only where it pays)
SPLIT = ("--disagg-split-when", "always")


def transfer_part(rounds: int) -> None:
    backends = ["tcp"] + (["nixl"] if nixl_available() else [])
    print(f"\nKV transfer of {TOTAL_BYTES >> 20} MiB ({TOTAL_BYTES // BLOCK_BYTES} blocks of {BLOCK_BYTES >> 10} KiB)")
    print("between two processes on this machine; median of", rounds, "pulls (first pull is warm-up, not counted)")
    print(f"{'backend':8} {'move ms':>9} {'GB/s':>7} {'with verify ms':>15} {'GB/s':>7}")
    for backend in backends:
        with tempfile.NamedTemporaryFile(suffix=".port") as port_file:
            child = subprocess.Popen(
                [sys.executable, "-m", "bench.disagg_bench", "--serve-rooms", backend, "--port-file", port_file.name],
                stderr=subprocess.DEVNULL,
            )
            try:
                deadline = time.monotonic() + 60
                while not Path(port_file.name).read_text().strip():
                    if time.monotonic() > deadline or child.poll() is not None:
                        raise RuntimeError("the transfer server did not start")
                    time.sleep(0.05)
                port = int(Path(port_file.name).read_text())
                raw = asyncio.run(pull_rounds(backend, port, rounds + 1, False, 0))[1:]
                checked = asyncio.run(pull_rounds(backend, port, rounds + 1, True, rounds + 1))[1:]
            finally:
                child.kill()
                child.wait()
        move, full = sorted(raw)[len(raw) // 2], sorted(checked)[len(checked) // 2]
        print(
            f"{backend:8} {move * 1000:9.2f} {TOTAL_BYTES / move / 1e9:7.2f} "
            f"{full * 1000:15.2f} {TOTAL_BYTES / full / 1e9:7.2f}"
        )


# ---- serving a trace -----------------------------------------------------------------------------
def router_prefill_counts(nats_url: str) -> dict[str, float]:
    """The router's prefills by where they ran (and why, for those with a reason), and the MiB its
    KV transfers moved by backend."""
    (router,) = discovered(nats_url, "router")
    page = scrape(router.extra["metrics"])
    counts: dict[str, float] = {}
    for labels, value in page.get("kvmesh_router_prefills_total", []):
        counts[labels["where"] + (f"/{labels['reason']}" if labels["reason"] else "")] = value
    for labels, value in page.get("kvmesh_router_kv_transfer_bytes_total", []):
        counts[f"MiB/{labels['backend']}"] = round(value / 2**20, 1)
    return counts


def serving_part(args: argparse.Namespace) -> None:
    setups = [
        ("3 aggregated", ["--workers", "3"]),
        ("1 prefill + 2 decode", ["--workers", "2", "--prefill-workers", "1", *SPLIT]),
    ] + [
        (
            f"1P+2D, queue ≤ {limit // 1024}k",
            ["--workers", "2", "--prefill-workers", "1", "--prefill-queue-limit-tokens", str(limit), *SPLIT],
        )
        for limit in args.queue_limits
    ]
    common = ["--speedup-ratio", str(args.speedup_ratio), "--log-level", "warning"]
    rows = []
    for label, setup in setups:
        mesh = MeshProcess(*common, *setup).start(timeout=120)
        try:
            report = run_load(
                mesh.api,
                label,
                "--trace",
                str(args.trace),
                "--limit",
                str(args.limit),
                "--request-rate",
                str(args.request_rate),
                "--max-output-tokens",
                str(args.max_output_tokens),
            )
            prefills = router_prefill_counts(mesh.nats_url)
        finally:
            mesh.stop()
        rows.append((label, report, prefills))
    print(
        f"\nMooncake trace, first {args.limit} requests at {args.request_rate} req/s, output ≤ "
        f"{args.max_output_tokens} tokens, mock workers at speed-up {args.speedup_ratio}"
    )
    print(
        f"{'setup':22} {'ok':>4} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'mean':>8} {'ITL mean':>9} "
        f"{'ITL p99':>8} {'req/s':>6} {'out tok/s':>9}  prefills"
    )
    for label, report, prefills in rows:
        ttft, itl = report["ttft_ms"], report["itl_ms"]
        print(
            f"{label:22} {report['completed']:>4} {ttft['p50']:9.1f} {ttft['p90']:8.1f} {ttft['p99']:8.1f} "
            f"{ttft['mean']:8.1f} {itl['mean']:9.2f} {itl['p99']:8.2f} {report['request_throughput_per_s']:6.2f} "
            f"{report['output_tokens_per_s']:9.1f}  {prefills}"
        )


# ---- the same comparison in virtual time -----------------------------------------------------------
def replay_part(args: argparse.Namespace) -> None:
    """``kvmesh replay``'s engine and the router's own pipeline in virtual time: no CPU contention,
    Dynamo's timing model, a modelled model (128 KiB of KV per token) over a 25 GB/s link. Each
    disaggregated fleet runs under both split rules: ``always`` (every request the thresholds allow)
    and ``gain`` (the default: only where the split is predicted to cost less, decode stall counted)."""
    from kvmesh.replay.cli import fleet_summary
    from kvmesh.replay.config import ReplayConfig
    from kvmesh.replay.mooncake_trace import read_trace
    from kvmesh.replay.report import summarise
    from kvmesh.replay.simulator import ReplaySimulator

    trace = read_trace(args.trace)[: args.replay_limit]
    setups = [
        ("3 aggregated", 3, 0, "gain"),
        ("1P + 2D, always", 2, 1, "always"),
        ("1P + 2D, gain", 2, 1, "gain"),
        ("6 aggregated", 6, 0, "gain"),
        ("2P + 4D, always", 4, 2, "always"),
        ("2P + 4D, gain", 4, 2, "gain"),
    ]
    print(f"\nReplay in virtual time of {len(trace)} trace requests (64-token blocks, Dynamo's timing model)")
    print(
        f"{'speed-up':>8} {'setup':18} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>7} {'worker-s':>9}  prefills"
    )
    for speedup in args.replay_speedups:
        for label, workers, prefill, split_when in setups:
            config = ReplayConfig(
                workers=workers, prefill_workers=prefill, arrival_speedup_ratio=speedup, disagg_split_when=split_when
            )
            simulator = ReplaySimulator(config)
            records = simulator.run(trace)
            summary = summarise(records)
            cost = fleet_summary(simulator, records, config)["worker_seconds"]
            ttft, itl = summary["ttft_ms"], summary["itl_ms"]
            print(
                f"{speedup:>8} {label:18} {ttft['p50']:9.1f} {ttft['p99']:8.1f} {itl['p50']:8.2f} {itl['p99']:7.2f} "
                f"{cost:9.0f}  {summary.get('prefills', '')}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("transfer", "serving", "replay", "all"), default="all")
    parser.add_argument(
        "--replay-speedups", type=float, nargs="+", default=[1.0, 2.0], help="replay: trace arrival speed-ups"
    )
    parser.add_argument("--replay-limit", type=int, default=None, help="replay: only the first N trace requests")
    parser.add_argument("--rounds", type=int, default=5, help="transfer: pulls per backend")
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--limit", type=int, default=120, help="serving: trace requests to send")
    parser.add_argument("--request-rate", type=float, default=2.0, help="serving: requests per second")
    parser.add_argument("--max-output-tokens", type=int, default=64)
    parser.add_argument("--speedup-ratio", type=float, default=10.0, help="mock engine speed-up")
    parser.add_argument(
        "--queue-limits",
        type=int,
        nargs="*",
        default=[],
        help="serving: also run 1P+2D with these --prefill-queue-limit-tokens values",
    )
    parser.add_argument("--serve-rooms", choices=("tcp", "nixl"), help=argparse.SUPPRESS)
    parser.add_argument("--port-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_rooms:
        asyncio.run(serve_rooms(args.serve_rooms, args.port_file))
        return
    if args.part in ("transfer", "all"):
        transfer_part(args.rounds)
    if args.part in ("serving", "all"):
        serving_part(args)
    if args.part in ("replay", "all"):
        replay_part(args)


if __name__ == "__main__":
    main()
