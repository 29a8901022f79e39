"""Latency the full HTTP → frontend → router → worker path adds over calling a worker directly.

Starts ``kvmesh up`` (mock engine at a high speed-up so the engine itself costs almost nothing),
then sends the same short non-streaming requests two ways — through the OpenAI HTTP API and
straight to one worker's ``Generate`` over gRPC — at concurrency 1 and 8, and prints p50 / p99 of
each and the difference. Not a test: run it and read the figures.

    python -m bench.path_latency --requests 500
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable

import grpc
import httpx
import nats

from kvmesh.common.core.tiny_model import MODEL_DIR, MODEL_NAME
from kvmesh.common.proto.kvmesh.v1 import common_pb2, worker_pb2_grpc
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.devtools.mesh_process import MeshProcess
from kvmesh.frontend.tokenizer import ModelTokenizer

MAX_TOKENS = 4


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def measure(send: Callable[[int], Awaitable[None]], requests: int, concurrency: int) -> list[float]:
    latencies: list[float] = []
    next_index = iter(range(requests))

    async def client() -> None:
        for i in next_index:
            started = time.perf_counter()
            await send(i)
            latencies.append((time.perf_counter() - started) * 1000)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies


def prompt(i: int) -> str:
    return f"request {i}: a short prompt for the latency benchmark"


async def run(args: argparse.Namespace, base_url: str, nats_url: str) -> dict[str, dict[str, float]]:
    tokenizer = ModelTokenizer(MODEL_DIR)
    nc = await nats.connect(nats_url)
    watcher = DiscoveryWatcher(nc.jetstream(), "default", "worker")
    await watcher.start()
    worker_address = watcher.instances()[0].address
    await watcher.stop()
    await nc.close()

    http = httpx.AsyncClient(base_url=base_url, timeout=30, limits=httpx.Limits(max_connections=64))
    channel = grpc.aio.insecure_channel(worker_address)
    stub = worker_pb2_grpc.WorkerStub(channel)

    async def via_http(i: int) -> None:
        response = await http.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": prompt(i), "max_tokens": MAX_TOKENS}
        )
        response.raise_for_status()

    async def direct(i: int) -> None:
        request = common_pb2.PreprocessedRequest(
            request_id=f"direct-{i}-{time.monotonic_ns()}",
            model=MODEL_NAME,
            token_ids=tokenizer.encode(prompt(i)),
        )
        request.stop.max_tokens = MAX_TOKENS
        async for _ in stub.Generate(request):
            pass

    results: dict[str, dict[str, float]] = {}
    for concurrency in (1, 8):
        for name, send in (("worker-direct", direct), ("http-full-path", via_http)):
            await measure(send, min(50, args.requests), concurrency)  # warm-up
            latencies = await measure(send, args.requests, concurrency)
            results[f"{name} c={concurrency}"] = {
                "p50_ms": percentile(latencies, 50),
                "p99_ms": percentile(latencies, 99),
                "mean_ms": statistics.fmean(latencies),
            }
    await http.aclose()
    await channel.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500, help="requests per configuration")
    parser.add_argument("--speedup-ratio", type=float, default=1000.0, help="mock engine speed-up")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    mesh = MeshProcess("--speedup-ratio", str(args.speedup_ratio), "--log-level", "warning").start()
    try:
        results = asyncio.run(run(args, mesh.base_url, mesh.nats_url))
    finally:
        mesh.stop()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{args.requests} non-streaming requests, {MAX_TOKENS} output tokens, speed-up {args.speedup_ratio}")
    print(f"{'path':<24}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}")
    for name, figures in results.items():
        print(f"{name:<24}{figures['p50_ms']:>10.2f}{figures['p99_ms']:>10.2f}{figures['mean_ms']:>10.2f}")
    for concurrency in (1, 8):
        direct = results[f"worker-direct c={concurrency}"]
        full = results[f"http-full-path c={concurrency}"]
        print(
            f"added by HTTP+router at c={concurrency}: p50 {full['p50_ms'] - direct['p50_ms']:.2f} ms, "
            f"p99 {full['p99_ms'] - direct['p99_ms']:.2f} ms"
        )


if __name__ == "__main__":
    main()
