"""Router figures: routing decision time in process, and requests/s one router replica sustains.

Decision time: RoutingPolicy.choose (predicted-TTFT cost) over 8, 64 and 256 workers, each with 32
requests in flight, for a 2,048-token prompt (128 blocks of 16) whose prefix some workers cache.

Throughput: one router process in front of 4 mock workers at a high speed-up plus an indexer (all
separate processes); a closed loop of concurrent gRPC clients sends short requests for a fixed time.
The router's CPU use (from /proc) shows what bounds it.

    python -m bench.router_bench [--seconds 15] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time

from bench.processes import cpu_seconds
from kvmesh.client import RouterApi
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.common.runtime.nats_server import EmbeddedNatsServer
from kvmesh.common.runtime.process import connect_nats
from kvmesh.common.wire.hashing import local_block_hashes, sequence_hashes
from kvmesh.router.policy import RoutingPolicy
from kvmesh.router.scheduler import make_cost_model

BLOCK = 16
NAMESPACE = "bench"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def decision_time(workers: int, samples: int = 2000) -> tuple[float, float]:
    rng = random.Random(workers)
    policy = RoutingPolicy("kv", BLOCK, rng=rng, cost_model=make_cost_model("ttft", BLOCK, 8192, 16384))
    keys = [(w, 0) for w in range(workers)]
    for w in keys:
        for r in range(32):
            hashes = [rng.getrandbits(64) for _ in range(rng.randrange(20, 200))]
            policy.active.add(f"{w}-{r}", w, hashes, len(hashes) * BLOCK + 5, rng.randrange(0, 10))
            if r % 2:
                policy.active.mark_prefill_completed(f"{w}-{r}")
    prompt = list(range(2048))
    hashes = sequence_hashes(local_block_hashes(prompt, BLOCK))
    overlaps = {keys[i]: rng.randrange(0, 128) for i in range(0, workers, 3)}
    sizes = {k: rng.randrange(100, 10_000) for k in keys}
    timings = []
    for _ in range(samples):
        started = time.perf_counter_ns()
        policy.choose(keys, hashes, len(prompt), overlaps, sizes)
        timings.append((time.perf_counter_ns() - started) / 1000)
    return percentile(timings, 50), percentile(timings, 99)


async def throughput(seconds: float, concurrency: int) -> dict[str, float]:
    server = await EmbeddedNatsServer().start()
    common = ["--nats-url", server.url, "--namespace", NAMESPACE, "--log-level", "warning"]
    processes = [subprocess.Popen([sys.executable, "-m", "kvmesh.indexer", *common, "--metrics-port", "-1"])]
    processes += [
        subprocess.Popen([sys.executable, "-m", "kvmesh.worker", *common, "--speedup-ratio", "1000"]) for _ in range(4)
    ]
    router = subprocess.Popen([sys.executable, "-m", "kvmesh.router", *common])
    processes.append(router)
    try:
        nc = await connect_nats(server.url, name="bench")
        routers = DiscoveryWatcher(nc.jetstream(), NAMESPACE, "router")
        workers = DiscoveryWatcher(nc.jetstream(), NAMESPACE, "worker")
        await routers.start()
        await workers.start()
        await routers.wait_for(bool, 30)
        await workers.wait_for(lambda w: len(w) == 4, 30)
        address = routers.instances()[0].address
        done = 0
        latencies: list[float] = []

        async def client(index: int, deadline: float) -> None:
            nonlocal done
            async with RouterApi(address) as api:
                n = 0
                while time.monotonic() < deadline:
                    started = time.perf_counter()
                    async for _ in api.generate([index % 8] * 64 + [n % 251] * 8, max_tokens=4):
                        pass
                    latencies.append((time.perf_counter() - started) * 1000)
                    done += 1
                    n += 1

        warm = time.monotonic() + 2
        await asyncio.gather(*(client(i, warm) for i in range(concurrency)))
        done, latencies = 0, []
        indexer = processes[0]
        cpu_before, indexer_before = cpu_seconds([router.pid]), cpu_seconds([indexer.pid])
        started = time.monotonic()
        await asyncio.gather(*(client(i, started + seconds) for i in range(concurrency)))
        elapsed = time.monotonic() - started
        router_cpu = (cpu_seconds([router.pid]) - cpu_before) / elapsed
        indexer_cpu = (cpu_seconds([indexer.pid]) - indexer_before) / elapsed
        await routers.stop()
        await workers.stop()
        await nc.close()
        return {
            "requests_per_s": done / elapsed,
            "router_cpu_cores": router_cpu,
            "indexer_cpu_cores": indexer_cpu,
            "p50_ms": percentile(latencies, 50),
            "p99_ms": percentile(latencies, 99),
        }
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    for workers in (8, 64, 256):
        p50, p99 = decision_time(workers)
        print(f"routing decision, {workers:>3} workers: p50 {p50:7.1f} µs, p99 {p99:7.1f} µs")
    r = asyncio.run(throughput(args.seconds, args.concurrency))
    print(
        f"one router replica, 4 mock workers (speed-up 1000), {args.concurrency} concurrent clients: "
        f"{r['requests_per_s']:.0f} requests/s, latency p50 {r['p50_ms']:.1f} ms p99 {r['p99_ms']:.1f} ms, "
        f"router process CPU {r['router_cpu_cores']:.2f} cores of {os.cpu_count()}"
    )


if __name__ == "__main__":
    main()
