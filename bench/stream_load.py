"""Streamed chat load: the load of ``../shared/peers/loadgen.py``, streamed, with time to first event.

The same requests as loadgen's (16 shared ~200-word system prompts and a 20-word question, from the
same seeded generator, so prefix caching sees the same prompts), the same client (aiohttp, ``--c``
requests at a time, 20 warm-up requests not counted), but ``"stream": true``: every event is read to
``data: [DONE]``. Each request opens a new connection, as in the issue's side-by-side measurement:
on a kept-alive connection (``--keep-alive``) a server that leaves Nagle's algorithm on (Dynamo's,
the SGLang router's) holds its second small write until the client's delayed ACK, about 40 ms.
Prints one JSON line with loadgen's fields (``ok``, ``errors``, ``wall_s``, ``rps``, ``p50_ms``,
``p99_ms``, ``mean_ms``: the whole answer), the time to the first event (``ttft_p50_ms``,
``ttft_p99_ms``), the mean number of events an answer had before ``[DONE]``
(``events_per_answer``) and this client's own CPU per request while it ran the load
(``client_cpu_ms``; it shares the machine's cores with the server it measures).

Time to first token is read as time to the first event, not the first text: both kvmesh and Dynamo
send their first chunk when the first token is there. Dynamo's mocker draws random 32-bit token
ids, outside the peers' 450-token tiny tokenizer, so they decode to no text and Dynamo's answers
carry two events whatever their length (the role, then the finish reason). kvmesh's carry one per
batch of tokens with text (about 40 for 64 tokens at c=8): the events per answer show how much
less writing, and reading, Dynamo's streamed answers cost on this load.

``bench.serving_cpu --stream`` and ``bench.peers --stream`` run it; on its own:

    python -m bench.stream_load --url http://127.0.0.1:18100/v1/chat/completions --n 1000 --c 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import aiohttp

WARMUP = 20
# loadgen.py's prompt material, so that both loads send the same prompts
WORDS = [
    "the",
    "a",
    "cache",
    "router",
    "worker",
    "prefix",
    "token",
    "block",
    "hello",
    "world",
    "system",
    "user",
    "model",
    "kv",
    "llm",
]
GROUPS = 16


class StreamError(RuntimeError):
    """A response that is not a whole stream of events (wrong status, no [DONE])."""


def request_bodies(count: int, model: str, max_tokens: int, seed: int = 0) -> list[dict]:
    """loadgen.py's chat bodies, in its order, streamed."""
    rng = random.Random(seed)
    system_prompts = [" ".join(rng.choice(WORDS) for _ in range(200)) + f" group{g}" for g in range(GROUPS)]
    bodies = []
    for i in range(count):
        group = rng.randrange(GROUPS)
        question = " ".join(rng.choice(WORDS) for _ in range(20)) + f" q{i}"
        messages = [{"role": "system", "content": system_prompts[group]}, {"role": "user", "content": question}]
        bodies.append({"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True})
    return bodies


async def one(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, float, int]:
    """(ms to the first event, ms to the end of the stream, events before ``[DONE]``)."""
    started = time.perf_counter()
    first_event: float | None = None
    events = 0
    done = False
    async with session.post(url, json=body) as response:
        if response.status != 200:
            raise StreamError(f"HTTP {response.status}")
        async for line in response.content:
            if not line.startswith(b"data:"):
                continue
            if line.strip() == b"data: [DONE]":
                done = True
                continue
            events += 1
            if first_event is None:
                first_event = time.perf_counter()
    ended = time.perf_counter()
    if not done:
        raise StreamError("the stream ended without [DONE]")
    return ((first_event or ended) - started) * 1000, (ended - started) * 1000, events


def percentile(values: list[float], share: float) -> float:
    """loadgen.py's percentile: the value at ``int(share × n)`` of the sorted values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else float("nan")


async def run(args: argparse.Namespace) -> dict:
    bodies = request_bodies(WARMUP + args.n, args.model, args.max_tokens)
    timeout = aiohttp.ClientTimeout(total=60)
    connector = aiohttp.TCPConnector(limit=args.c, force_close=not args.keep_alive)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        pending = iter(range(len(bodies)))
        first_events: list[float] = []
        latencies: list[float] = []
        events = 0
        errors = 0

        async def client() -> None:
            nonlocal errors, events
            for i in pending:
                try:
                    first_event, latency, answer_events = await one(session, args.url, bodies[i])
                except (TimeoutError, aiohttp.ClientError, StreamError):
                    if i >= WARMUP:
                        errors += 1
                    continue
                if i >= WARMUP:
                    first_events.append(first_event)
                    latencies.append(latency)
                    events += answer_events

        started = time.perf_counter()  # as loadgen.py: the warm-up is inside the wall time
        cpu_started = time.process_time()
        await asyncio.gather(*(client() for _ in range(args.c)))
        wall = time.perf_counter() - started
        client_cpu = time.process_time() - cpu_started
    return {
        "ok": len(latencies),
        "errors": errors,
        "wall_s": round(wall, 3),
        "rps": round((len(latencies) + errors) / wall, 1),
        "ttft_p50_ms": round(percentile(first_events, 0.5), 2),
        "ttft_p99_ms": round(percentile(first_events, 0.99), 2),
        "p50_ms": round(percentile(latencies, 0.5), 2),
        "p99_ms": round(percentile(latencies, 0.99), 2),
        "mean_ms": round(sum(latencies) / len(latencies), 2) if latencies else None,
        "events_per_answer": round(events / len(latencies), 1) if latencies else None,
        "client_cpu_ms": round(client_cpu * 1000 / (WARMUP + len(latencies)), 3) if latencies else None,
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
    parser.add_argument("--keep-alive", action="store_true", help="reuse connections (default: a new one each)")
    print(json.dumps(asyncio.run(run(parser.parse_args()))))


if __name__ == "__main__":
    main()
