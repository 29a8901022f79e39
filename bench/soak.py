"""Soak: does any service grow under hours of traffic? (bounded: ``--minutes``)

Starts ``kvmesh up`` (mock workers), drives mixed traffic at a fixed concurrency — streaming and not,
chat and completions, shared prefixes, and one stream in ten abandoned mid-way by its client — and
samples every service's resident memory (RSS) and open file descriptors. Prints, per service, the
values at the end of the warm-up and at the end and the growth between them (target: < 5% for the
router, indexer and frontend over 20 minutes), and how many requests succeeded and failed.

    python -m bench.soak --minutes 20 --warmup-minutes 2 [--output soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import openai

from kvmesh.devtools.mesh_process import MeshProcess

SERVICES = ("frontend", "router", "indexer", "worker", "nats-server")


@dataclass
class Sample:
    seconds: float
    rss_kib: dict[str, int]
    fds: dict[str, int]


@dataclass
class Traffic:
    completed: int = 0
    abandoned: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)


def service_processes(parent: int) -> dict[str, int]:
    """The mesh's processes by service name (a second worker is ``worker-2``): children of ``parent``."""
    found: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != parent:
            continue
        name = next((s for s in SERVICES if f"kvmesh.{s}" in command or s in command.split(" ")[0]), None)
        if name is None:
            continue
        label, n = name, 1
        while label in found:
            n += 1
            label = f"{name}-{n}"
        found[label] = int(entry.name)
    return found


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def open_fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def sample(processes: dict[str, int], started: float) -> Sample:
    return Sample(
        time.monotonic() - started,
        {name: rss_kib(pid) for name, pid in processes.items()},
        {name: open_fds(pid) for name, pid in processes.items()},
    )


async def drive(api: str, deadline: float, concurrency: int, traffic: Traffic, seed: int) -> None:
    client = openai.AsyncOpenAI(base_url=api, api_key="unused", max_retries=0, timeout=60)
    rng = random.Random(seed)
    prefixes = [" ".join(f"context{p}-{i}" for i in range(rng.randrange(20, 120))) for p in range(20)]

    async def one() -> None:
        prompt = rng.choice(prefixes) + f" question {rng.randrange(10**6)}"
        max_tokens = rng.randrange(8, 200)
        kind = rng.random()
        if kind < 0.1:  # a client that walks away mid-stream
            stream = await client.completions.create(
                model="kvmesh-tiny", prompt=prompt, max_tokens=max_tokens + 50, stream=True
            )
            async for _ in stream:
                break
            await stream.close()
            traffic.abandoned += 1
        elif kind < 0.55:
            stream = await client.chat.completions.create(
                model="kvmesh-tiny",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                stream=True,
                stream_options={"include_usage": True},
            )
            async for _ in stream:
                pass
            traffic.completed += 1
        else:
            await client.completions.create(model="kvmesh-tiny", prompt=prompt, max_tokens=max_tokens)
            traffic.completed += 1

    async def user() -> None:
        while time.monotonic() < deadline:
            try:
                await one()
            except openai.APIError as exc:
                traffic.failed += 1
                key = type(exc).__name__
                traffic.errors[key] = traffic.errors.get(key, 0) + 1

    await asyncio.gather(*(user() for _ in range(concurrency)))
    await client.close()


async def soak(args: argparse.Namespace) -> dict:
    mesh = MeshProcess("--workers", "2", "--speedup-ratio", str(args.speedup_ratio), "--log-level", "warning").start()
    try:
        assert mesh.process is not None
        processes = service_processes(mesh.process.pid)
        started = time.monotonic()
        deadline = started + args.minutes * 60
        traffic = Traffic()
        load = asyncio.create_task(drive(mesh.api, deadline, args.concurrency, traffic, args.seed))
        samples = []
        while not load.done():
            samples.append(sample(processes, started))
            await asyncio.wait({load}, timeout=args.sample_secs)
        await load
        samples.append(sample(processes, started))
    finally:
        mesh.stop()
    warm = next((s for s in samples if s.seconds >= args.warmup_minutes * 60), samples[0])
    end = samples[-1]
    growth = {
        name: {
            "rss_mib_after_warmup": round(warm.rss_kib[name] / 1024, 1),
            "rss_mib_end": round(end.rss_kib[name] / 1024, 1),
            "rss_growth_pct": round(100 * (end.rss_kib[name] - warm.rss_kib[name]) / max(1, warm.rss_kib[name]), 2),
            "fds_after_warmup": warm.fds[name],
            "fds_end": end.fds[name],
        }
        for name in processes
    }
    return {
        "minutes": args.minutes,
        "warmup_minutes": args.warmup_minutes,
        "concurrency": args.concurrency,
        "traffic": asdict(traffic),
        "services": growth,
        "samples": [asdict(s) for s in samples],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="how long to drive traffic")
    parser.add_argument("--warmup-minutes", type=float, default=2.0, help="growth is measured from here")
    parser.add_argument("--concurrency", type=int, default=16, help="clients sending back to back")
    parser.add_argument("--speedup-ratio", type=float, default=20.0, help="mock workers' speed-up")
    parser.add_argument("--sample-secs", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="write the whole result (samples included) as JSON here")
    args = parser.parse_args()
    result = asyncio.run(soak(args))
    traffic = result["traffic"]
    print(
        f"soak: {args.minutes:g} min at concurrency {args.concurrency}: {traffic['completed']} completed, "
        f"{traffic['abandoned']} abandoned by their client, {traffic['failed']} failed {traffic['errors'] or ''}"
    )
    print(f"{'service':<14}{'RSS MiB warm':>14}{'RSS MiB end':>13}{'growth':>9}{'fds warm':>10}{'fds end':>9}")
    for name, row in sorted(result["services"].items()):
        print(
            f"{name:<14}{row['rss_mib_after_warmup']:>14}{row['rss_mib_end']:>13}{row['rss_growth_pct']:>8}%"
            f"{row['fds_after_warmup']:>10}{row['fds_end']:>9}"
        )
    if args.output:
        args.output.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
