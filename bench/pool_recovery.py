"""Recovery time of a stream whose worker dies: resumed from the host KV pool vs re-prefilled.

Runs ``kvmesh up --workers 2`` twice, without and with ``--kv-pool auto``. Each trial streams a fresh
long prompt through the request path (``kvmesh.client.RouterApi``), kills (SIGKILL) the worker serving it after a
few tokens, and measures the gap from the kill to the first token the other worker sends,
after the request migrates there. Without the pool that worker prefills the prompt and
the tokens so far; with it, it imports the dead worker's blocks from shared memory first.
``kvmesh up`` restarts the killed worker; the next trial waits for it.

    python -m bench.pool_recovery [--prompt-tokens 16384 --trials 5 --speedup-ratio 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import time

from kvmesh.client import RouterApi
from kvmesh.common.runtime.ports import pid_listening_on
from kvmesh.devtools.mesh_process import MeshProcess
from tests.support import discovered

KILL_AFTER_TOKENS = 5


async def one_trial(router: str, workers: dict[int, str], prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """(seconds from the kill to the next token, the killed worker)."""
    received, killed_at, gap, victim = 0, None, None, -1
    async with RouterApi(router) as api:
        async for output in api.generate(prompt, max_tokens, request_id=f"r{random.getrandbits(40)}"):
            received += len(output.token_ids)
            if killed_at is not None and gap is None and output.worker_id != victim:
                gap = time.perf_counter() - killed_at  # tokens already on their way do not count
            if killed_at is None and received >= KILL_AFTER_TOKENS:
                victim = output.worker_id
                port = int(workers[victim].rsplit(":", 1)[1])
                os.kill(pid_listening_on(port), signal.SIGKILL)
                killed_at = time.perf_counter()
    if gap is None or received != max_tokens:
        raise RuntimeError(f"the stream ended after {received} of {max_tokens} tokens without resuming")
    return gap, victim


def wait_for_workers(mesh: MeshProcess, count: int, dead: set[int], timeout: float = 60) -> dict[int, str]:
    """The registered workers once there are ``count`` and none of ``dead`` (killed, lease not yet out)."""
    deadline = time.monotonic() + timeout
    while True:
        found = {r.instance_id: r.address for r in discovered(mesh.nats_url, "worker")}
        if len(found) == count and not dead & found.keys():
            return found
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(found)} of {count} workers registered after {timeout} s")
        time.sleep(0.5)


def run(pool: bool, args: argparse.Namespace) -> list[float]:
    flags = ["--workers", "2", "--speedup-ratio", str(args.speedup_ratio), "--log-level", "warning"]
    mesh = MeshProcess(*flags, *(["--kv-pool", "auto"] if pool else [])).start(timeout=120)
    rng = random.Random(args.seed)
    gaps, dead = [], set()
    try:
        for trial in range(args.trials):
            workers = wait_for_workers(mesh, 2, dead)
            # each trial's prompt is new to every cache: nothing but the pool can spare its prefill
            prompt = [rng.randrange(1, 30000) for _ in range(args.prompt_tokens)]
            router = discovered(mesh.nats_url, "router")[0].address
            gap, victim = asyncio.run(one_trial(router, workers, prompt, args.max_tokens))
            gaps.append(gap)
            dead.add(victim)
            print(f"  {'pool' if pool else 're-prefill'} trial {trial}: {gaps[-1] * 1000:.1f} ms", flush=True)
    finally:
        mesh.stop()
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=16384)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--speedup-ratio", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    without = run(False, args)
    with_pool = run(True, args)
    a, b = statistics.median(without), statistics.median(with_pool)
    print(f"prompt {args.prompt_tokens} tokens, {args.trials} kills each, speed-up {args.speedup_ratio}")
    print(f"recovery, re-prefill: median {a * 1000:.1f} ms (mean {statistics.mean(without) * 1000:.1f})")
    print(f"recovery, KV pool:    median {b * 1000:.1f} ms (mean {statistics.mean(with_pool) * 1000:.1f})")
    print(f"the pool recovers {1 - b / a:.1%} faster (median)")


if __name__ == "__main__":
    main()
