"""Streamed chat load: ``../shared/peers/loadgen.py``'s non-streaming load, streamed.

Sends ``--n`` streamed chat requests, ``--c`` at a time, each on a new connection, reads every
event to the end, and prints one JSON line with loadgen's fields (``ok``, ``errors``, ``wall_s``,
``p50_ms``, ``p99_ms``). ``bench.serving_cpu --stream`` runs it; on its own:

    python -m bench.stream_load --url http://127.0.0.1:18100/v1/chat/completions --n 1000 --c 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

WARMUP = 20


async def one(http: httpx.AsyncClient, url: str, body: dict) -> float:
    """The request's latency in ms; raises on any status but 200 or a stream without its end."""
    started = time.perf_counter()
    async with http.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}")
        last = b""
        async for chunk in response.aiter_bytes():
            last = chunk or last
    if not last.rstrip().endswith(b"data: [DONE]"):
        raise RuntimeError("the stream ended without [DONE]")
    return (time.perf_counter() - started) * 1000


async def run(args: argparse.Namespace) -> dict:
    def body(i: int) -> dict:
        question = f"question {i % 97}: what comes after {i}?"
        return {
            "model": args.model,
            "stream": True,
            "max_tokens": args.max_tokens,
            "messages": [
                {"role": "system", "content": f"You are assistant {i % 16}."},
                {"role": "user", "content": question},
            ],
        }

    limits = httpx.Limits(max_keepalive_connections=0)  # a new connection per request, as loadgen
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        await asyncio.gather(*(one(http, args.url, body(-i)) for i in range(1, WARMUP + 1)))
        gate = asyncio.Semaphore(args.c)
        latencies: list[float] = []
        errors = 0

        async def limited(i: int) -> None:
            nonlocal errors
            async with gate:
                try:
                    latencies.append(await one(http, args.url, body(i)))
                except (httpx.HTTPError, RuntimeError):
                    errors += 1

        started = time.perf_counter()
        await asyncio.gather(*(limited(i) for i in range(args.n)))
        wall = time.perf_counter() - started
    quantiles = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [0.0] * 99
    return {
        "ok": len(latencies),
        "errors": errors,
        "wall_s": round(wall, 3),
        "rps": round(len(latencies) / wall, 1),
        "p50_ms": round(quantiles[49], 2),
        "p99_ms": round(quantiles[98], 2),
    }


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The load's options, shared with ``bench.serving_cpu`` (which passes them on)."""
    parser.add_argument("--url", required=True, help="the chat completions URL (loopback only)")
    parser.add_argument("--n", type=int, default=1000, help="requests")
    parser.add_argument("--c", type=int, default=8, help="concurrency")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default="kvmesh-tiny")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_load_arguments(parser)
    print(json.dumps(asyncio.run(run(parser.parse_args()))))


if __name__ == "__main__":
    main()
