"""Router figures: routing decision time in process, and requests/s one router replica sustains.

Decision time: RoutingPolicy.choose (predicted-TTFT cost) over 8, 64 and 256 workers, each with 32
requests in flight, for a 2,048-token prompt (128 blocks of 16) whose prefix some workers cache:
plain ``kv`` (the cost of the request in hand alone) and then, back to back, ``kv`` with the router's
default options (or those given), with the ratio of the two medians. Then the router's whole
decision in process with its default options, as the service makes it for one request (its candidates,
the prompt's block hashes and the choice on an index answer in hand; no gRPC, no NATS), plain and for a
request naming a session (whose pull is priced).

Throughput: one router process in front of 4 mock workers at a high speed-up plus an indexer (all
separate processes); a closed loop of concurrent gRPC clients sends short requests for a fixed time.
The router's CPU use (from /proc) shows what bounds it.

Saturation (``--saturation``): the same, but the router alone runs under a CPU quota (a cgroup of
its own: ``--router-cores`` of a core each), so that it, not its load generator, indexer or mock
workers (which share what is left of the machine), runs out first. Closed loops of rising
concurrency find where its requests/s stop growing while it uses its whole quota; two quotas show
whether that point scales with the CPU it is given. Needs root and a cgroup CPU controller.

    python -m bench.router_bench [--seconds 15] [--concurrency 32]
    python -m bench.router_bench --saturation [--router-cores 0.25 0.5] [--seconds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time

from bench.cpu_quota import PERIOD_US, CpuQuota, CpuQuotaError
from bench.processes import cpu_seconds
from kvmesh.client import RouterApi
from kvmesh.common.core.index_answer import IndexAnswer
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.common.runtime.nats_server import EmbeddedNatsServer
from kvmesh.common.runtime.process import connect_nats
from kvmesh.common.wire.hashing import local_block_hashes, sequence_hashes
from kvmesh.common.wire.worker_key import WorkerKey
from kvmesh.replay.fleet import REPLAY_MODEL, RoutableWorkers
from kvmesh.router.candidates import RouteInput
from kvmesh.router.config import RouterConfig
from kvmesh.router.policy import RoutingPolicy
from kvmesh.router.routing import Router
from kvmesh.router.scheduler import make_cost_model

BLOCK = 16
NAMESPACE = "bench"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def decision_time(
    workers: int,
    samples: int = 2000,
    duplicate_penalty: float = 0.0,
    write_spread: float = 0.0,
    mostly_new: bool = False,
    stall_slack: float = 0.0,
    pull_ratio: float = 0.0,
) -> tuple[float, float]:
    """p50 and p99 of one decision, in µs. ``mostly_new``: no worker caches more than 29% of the prompt,
    so with the penalty the decision takes decision 58's and 59's path (the write counts read).
    ``stall_slack``: decision 63's check, over workers whose prefill queues wait but none past it.
    ``pull_ratio``: decision 70's pricing of a pull, every worker able to pull (the costs with the
    holder's prefix evaluated on every decision, whether or not the holder is saturated)."""
    rng = random.Random(workers)
    cost_model = make_cost_model("ttft", BLOCK, 8192, 16384)
    policy = RoutingPolicy(
        "kv",
        BLOCK,
        rng=rng,
        cost_model=cost_model,
        duplicate_penalty=duplicate_penalty,
        write_spread=write_spread,
        stall_slack=stall_slack,
        pull_ratio=pull_ratio,
        pull_ms_per_token=0.00524,
    )
    keys = [(w, 0) for w in range(workers)]
    pullable = set(keys) if pull_ratio else set()
    for w in keys:
        for r in range(32):
            hashes = [rng.getrandbits(64) for _ in range(rng.randrange(20, 200))]
            policy.active.add(f"{w}-{r}", w, hashes, len(hashes) * BLOCK + 5, rng.randrange(0, 10))
            if r % 2:
                policy.active.mark_prefill_completed(f"{w}-{r}")
    prompt = list(range(2048))
    hashes = sequence_hashes(local_block_hashes(prompt, BLOCK))
    overlaps = {keys[i]: rng.randrange(0, 38 if mostly_new else 128) for i in range(0, workers, 3)}
    sizes = {k: rng.randrange(100, 10_000) for k in keys}
    timings = []
    for _ in range(samples):
        started = time.perf_counter_ns()
        policy.choose(keys, hashes, len(prompt), overlaps, sizes, pullable=pullable)
        timings.append((time.perf_counter_ns() - started) / 1000)
    return percentile(timings, 50), percentile(timings, 99)


def pipeline_time(workers: int, samples: int = 2000, session: bool = False) -> tuple[float, float]:
    """p50 and p99, in µs, of the router's whole decision for one request, as the router service makes
    it with its default options and without gRPC or NATS: the candidates and the prompt's block hashes
    (``Router.prepare``) and the choice (``Router.decide``, not committed, so each sample meets the same
    load) on an index answer in hand. ``session``: the request names a session (the pull is priced,
    every worker able to pull). The fleet, prompt and index answer are drawn as :func:`decision_time`
    draws them; the 32 requests in flight on each worker all still prefill (none marked done)."""
    rng = random.Random(workers)
    fleet = RoutableWorkers(BLOCK, 16384, 8192)
    for w in range(workers):
        fleet.join(w, "aggregated")
    router = Router(RouterConfig(), fleet, None, router_id="bench", clock=lambda: 100.0, rng=rng)
    for record in fleet.instances():
        for r in range(32):
            hashes = [rng.getrandbits(64) for _ in range(rng.randrange(20, 200))]
            router.track_add(f"{record.instance_id}-{r}", record, hashes, len(hashes) * BLOCK + 5, 0, 10)
    prompt = list(range(2048))
    hashes = sequence_hashes(local_block_hashes(prompt, BLOCK))
    answer = IndexAnswer(
        {WorkerKey(w, 0): rng.randrange(0, 128) for w in range(0, workers, 3)},
        {WorkerKey(w, 0): rng.randrange(100, 10_000) for w in range(workers)},
    )
    assert answer.matched and len(hashes) == 128
    request = RouteInput(REPLAY_MODEL, prompt, session="bench" if session else "")
    timings = []
    for _ in range(samples):
        started = time.perf_counter_ns()
        router.decide(router.prepare(request), answer, commit=False)
        timings.append((time.perf_counter_ns() - started) / 1000)
    return percentile(timings, 50), percentile(timings, 99)


class Fleet:
    """NATS, an indexer, 4 mock workers (speed-up 1000) and one router, each its own process; the
    router under ``quota`` where one is given."""

    def __init__(self, quota: CpuQuota | None = None) -> None:
        self.quota = quota
        self.processes: list[subprocess.Popen[bytes]] = []

    async def __aenter__(self) -> Fleet:
        self.server = await EmbeddedNatsServer().start()
        common = ["--nats-url", self.server.url, "--namespace", NAMESPACE, "--log-level", "warning"]
        self.indexer = subprocess.Popen([sys.executable, "-m", "kvmesh.indexer", *common, "--metrics-port", "-1"])
        self.processes = [self.indexer]
        self.processes += [
            subprocess.Popen([sys.executable, "-m", "kvmesh.worker", *common, "--speedup-ratio", "1000"])
            for _ in range(4)
        ]
        self.router = subprocess.Popen([sys.executable, "-m", "kvmesh.router", *common])
        self.processes.append(self.router)
        if self.quota is not None:
            self.quota.add(self.router.pid)
        self.nc = await connect_nats(self.server.url, name="bench")
        routers = DiscoveryWatcher(self.nc.jetstream(), NAMESPACE, "router")
        workers = DiscoveryWatcher(self.nc.jetstream(), NAMESPACE, "worker")
        await routers.start()
        await workers.start()
        await routers.wait_for(bool, 60)
        await workers.wait_for(lambda w: len(w) == 4, 60)
        self.address = routers.instances()[0].address
        await routers.stop()
        await workers.stop()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.nc.close()
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.wait(timeout=30)
        self.server.stop()

    async def load(self, seconds: float, concurrency: int, warm_s: float = 2.0) -> dict[str, float]:
        """A closed loop of ``concurrency`` clients for ``seconds`` (after ``warm_s`` unmeasured)."""
        done = 0
        latencies: list[float] = []

        async def client(index: int, deadline: float) -> None:
            nonlocal done
            async with RouterApi(self.address) as api:
                n = 0
                while time.monotonic() < deadline:
                    started = time.perf_counter()
                    async for _ in api.generate([index % 8] * 64 + [n % 251] * 8, max_tokens=4):
                        pass
                    latencies.append((time.perf_counter() - started) * 1000)
                    done += 1
                    n += 1

        await asyncio.gather(*(client(i, time.monotonic() + warm_s) for i in range(concurrency)))
        done, latencies = 0, []
        others = [p.pid for p in self.processes if p is not self.router] + [os.getpid()]
        router_before, indexer_before = cpu_seconds([self.router.pid]), cpu_seconds([self.indexer.pid])
        others_before = cpu_seconds(others) + self.server_cpu()
        throttled_before = self.quota.throttled() if self.quota else 0
        started = time.monotonic()
        await asyncio.gather(*(client(i, started + seconds) for i in range(concurrency)))
        elapsed = time.monotonic() - started
        return {
            "requests_per_s": done / elapsed,
            "router_cpu_cores": (cpu_seconds([self.router.pid]) - router_before) / elapsed,
            "indexer_cpu_cores": (cpu_seconds([self.indexer.pid]) - indexer_before) / elapsed,
            # everything but the router: its load generator (this process), workers, indexer, NATS
            "others_cpu_cores": (cpu_seconds(others) + self.server_cpu() - others_before) / elapsed,
            "throttled_periods": (self.quota.throttled() - throttled_before) if self.quota else 0,
            "p50_ms": percentile(latencies, 50),
            "p99_ms": percentile(latencies, 99),
        }

    def server_cpu(self) -> float:
        pid = self.server.pid
        return cpu_seconds([pid]) if pid is not None else 0.0


async def throughput(seconds: float, concurrency: int) -> dict[str, float]:
    async with Fleet() as fleet:
        return await fleet.load(seconds, concurrency)


async def saturation(cores: float, seconds: float, concurrencies: list[int]) -> list[dict[str, float]]:
    """The router under a quota of ``cores``, at each concurrency in turn (one fleet for all)."""
    with CpuQuota(f"kvmesh-router-bench-{os.getpid()}", cores) as quota:
        async with Fleet(quota) as fleet:
            rows = []
            for concurrency in concurrencies:
                row = await fleet.load(seconds, concurrency)
                row["concurrency"] = concurrency
                rows.append(row)
            return rows


def saturated_at(rows: list[dict[str, float]], quota_cores: float, seconds: float) -> dict[str, float] | None:
    """The most requests/s of the levels at which the router was held by its quota (it used at least
    90% of it and was throttled in at least half the quota's periods): its capacity under that
    quota (None: never held, so something else ran out first)."""
    periods = seconds / (PERIOD_US / 1e6)
    held = [
        row
        for row in rows
        if row["router_cpu_cores"] >= 0.9 * quota_cores and row["throttled_periods"] >= 0.5 * periods
    ]
    return max(held, key=lambda row: row["requests_per_s"]) if held else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--saturation", action="store_true", help="find one router replica's saturation point")
    parser.add_argument("--router-cores", type=float, nargs="+", default=[0.25, 0.5], help="--saturation: quotas")
    parser.add_argument(
        "--levels", type=int, nargs="+", default=[4, 8, 16, 32, 64], help="--saturation: concurrencies, rising"
    )
    parser.add_argument("--decision-samples", type=int, default=2000, help="decisions timed at each fleet size")
    defaults = RouterConfig()
    parser.add_argument(
        "--kv-duplicate-penalty",
        type=float,
        default=defaults.kv_duplicate_penalty,
        help="decision time: the policy's duplicate penalty (with it, also the in-flight prefixes it reads; "
        "default: the router's)",
    )
    parser.add_argument(
        "--kv-write-spread",
        type=float,
        default=defaults.kv_write_spread,
        help="decision time: the policy's write spread (decision 59; default: the router's)",
    )
    parser.add_argument(
        "--kv-stall-slack",
        type=float,
        default=defaults.kv_stall_slack,
        help="decision time: the policy's stall slack (decision 63; default: the router's)",
    )
    parser.add_argument(
        "--kv-pull-ratio",
        type=float,
        default=defaults.kv_pull_ratio,
        help="decision time: the policy's pull ratio (decision 70; default: the router's)",
    )
    parser.add_argument(
        "--mostly-new",
        action="store_true",
        help="decision time: a prompt no worker caches more than 29%% of (with the penalty, decisions 58 and 59)",
    )
    args = parser.parse_args()
    if args.saturation:
        for cores in args.router_cores:
            try:
                rows = asyncio.run(saturation(cores, args.seconds, args.levels))
            except CpuQuotaError as exc:
                raise SystemExit(f"--saturation: {exc}") from exc
            for r in rows:
                print(
                    f"router under {cores:g} cores, {r['concurrency']:>3} clients: "
                    f"{r['requests_per_s']:6.0f} requests/s, router {r['router_cpu_cores']:.2f} cores "
                    f"({r['throttled_periods']:.0f} periods throttled), everything else "
                    f"{r['others_cpu_cores']:.2f} cores, p50 {r['p50_ms']:.1f} ms p99 {r['p99_ms']:.1f} ms",
                    flush=True,
                )
            point = saturated_at(rows, cores, args.seconds)
            if point is None:
                print(f"router under {cores:g} cores: its quota never held it (something else ran out first)")
            else:
                print(
                    f"router under {cores:g} cores: saturated at {point['requests_per_s']:.0f} requests/s "
                    f"({point['concurrency']:.0f} clients; {point['requests_per_s'] / cores:,.0f} requests/s per core, "
                    f"{point['router_cpu_cores'] / point['requests_per_s'] * 1e6:.0f} µs of CPU a request)",
                    flush=True,
                )
        return
    options = args.kv_duplicate_penalty, args.kv_write_spread, args.mostly_new, args.kv_stall_slack, args.kv_pull_ratio
    for workers in (8, 64, 256):
        # plain kv first, then the policy with the options, back to back: this machine's speed drifts by
        # tens of per cent a minute, so the ratio of the two is the figure to compare across runs
        plain, _ = decision_time(workers, args.decision_samples)
        p50, p99 = decision_time(workers, args.decision_samples, *options)
        print(
            f"routing decision, {workers:>3} workers: p50 {p50:7.1f} µs, p99 {p99:7.1f} µs "
            f"({p50 / plain:.2f}x plain kv's p50, {plain:.1f} µs)"
        )
    for workers in (8, 64, 256):
        p50, p99 = pipeline_time(workers, args.decision_samples)
        session_p50, session_p99 = pipeline_time(workers, args.decision_samples, session=True)
        print(
            f"whole decision (candidates, block hashes, choice; the router's defaults), {workers:>3} workers: "
            f"p50 {p50:7.1f} µs, p99 {p99:7.1f} µs; a session's turn: p50 {session_p50:7.1f} µs, "
            f"p99 {session_p99:7.1f} µs"
        )
    r = asyncio.run(throughput(args.seconds, args.concurrency))
    print(
        f"one router replica, 4 mock workers (speed-up 1000), {args.concurrency} concurrent clients: "
        f"{r['requests_per_s']:.0f} requests/s, latency p50 {r['p50_ms']:.1f} ms p99 {r['p99_ms']:.1f} ms, "
        f"router process CPU {r['router_cpu_cores']:.2f} cores of {os.cpu_count()}"
    )


if __name__ == "__main__":
    main()
