"""Helpers shared by the tests: waiting on conditions (never bare sleeps) and free ports."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import httpx
import nats
import openai
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.common.core.tiny_model import MODEL_DIR
from kvmesh.common.proto.kvmesh.v1 import common_pb2, indexer_pb2, indexer_pb2_grpc
from kvmesh.common.runtime.config import parse_config
from kvmesh.common.runtime.discovery import DiscoveryWatcher, InstanceRecord, registered_now
from kvmesh.common.runtime.ports import free_port
from kvmesh.indexer import snapshot as snapshots
from kvmesh.indexer.snapshot import Snapshot
from kvmesh.indexer.snapshot_lock import SnapshotLock

__all__ = [
    "StreamedAnswer",
    "api_answers",
    "discovered",
    "free_port",
    "metric_samples",
    "metric_value",
    "running",
    "scrape",
    "service_config",
    "service_process",
    "small_context_model",
    "stream_chat",
    "streams_interrupted_by",
    "wait_until",
    "wait_until_async",
]

ConfigT = TypeVar("ConfigT")


async def wait_until_async(
    condition: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0, what: str = "condition"
) -> None:
    """Poll ``condition`` until it holds; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def wait_until(condition: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


@contextlib.asynccontextmanager
async def running(serve: Callable[[Any, asyncio.Event], Awaitable[None]], config: Any) -> AsyncIterator[None]:
    """Run a service's ``serve(config, stop)`` in this event loop; stop it cleanly on exit."""
    stop = asyncio.Event()
    task = asyncio.create_task(serve(config, stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=15)


def service_process(service: str, nats_url: str, namespace: str, *args: str) -> subprocess.Popen[bytes]:
    """``python -m kvmesh.<service>`` as a real process (for kill -9 drills)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            f"kvmesh.{service}",
            "--nats-url",
            nats_url,
            "--namespace",
            namespace,
            "--log-level",
            "warning",
            *args,
        ],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@dataclass(frozen=True)
class StreamedAnswer:
    """What one streamed chat completion delivered to the client."""

    text: str
    completion_tokens: int  # from the final usage chunk
    finish_reason: str | None


def assert_every_stream_whole(results: list[StreamedAnswer], streams: int, max_tokens: int) -> None:
    """Every one of ``streams`` answers arrived whole: all ``max_tokens`` tokens, finished by length."""
    assert len(results) == streams
    for answer in results:
        assert answer.finish_reason == "length"
        assert answer.completion_tokens == max_tokens and len(answer.text) == max_tokens


def api_answers(api: str) -> bool:
    """Whether the frontend at ``api`` (its ``.../v1`` base) is ready to serve: it lists its models
    and its ``/health`` says it knows a router (for waiting on start-up). Models alone are listed
    before the frontend has discovered any router, and a chat sent then gets 503."""
    try:
        if not openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=2).models.list().data:
            return False
        return httpx.get(api.removesuffix("/").removesuffix("/v1") + "/health", timeout=2).status_code == 200
    except (openai.APIError, httpx.HTTPError):
        return False


async def stream_chat(
    client: openai.AsyncOpenAI,
    content: str,
    max_tokens: int,
    model: str = "kvmesh-tiny",
    on_first_token: Callable[[], None] | None = None,
) -> StreamedAnswer:
    """One streaming chat completion read to its end; ``on_first_token`` runs at its first chunk."""
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    text: list[str] = []
    usage, finish = 0, None
    async for chunk in stream:
        if chunk.choices:
            if not text and on_first_token is not None:
                on_first_token()
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return StreamedAnswer("".join(text), usage, finish)


async def streams_interrupted_by(
    api: str,
    interruption: Callable[[], Awaitable[object]],
    *,
    streams: int,
    max_tokens: int,
    after_started: int,
    timeout: float = 120,
) -> list[StreamedAnswer]:
    """``streams`` concurrent streaming chats against ``api``; ``interruption`` (a kill, a stop, a
    restart) runs once ``after_started`` of them have begun. Returns every answer, in order."""
    client = openai.AsyncOpenAI(base_url=api, api_key="unused", max_retries=0, timeout=timeout)
    started = 0
    enough_started = asyncio.Event()

    def count_started() -> None:
        nonlocal started
        started += 1
        if started >= after_started:
            enough_started.set()

    prompts = [f"request {i}: a long answer" for i in range(streams)]
    tasks = [asyncio.create_task(stream_chat(client, p, max_tokens, on_first_token=count_started)) for p in prompts]
    try:
        await asyncio.wait_for(enough_started.wait(), timeout=60)
        await interruption()
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=timeout)
    finally:
        for task in tasks:
            task.cancel()
        await client.close()


def service_config(config_class: type[ConfigT], argv: list[str]) -> ConfigT:
    """A service's typed configuration exactly as its command line builds it, blind to ``KVMESH_*``
    variables of the machine running the tests."""
    return parse_config(config_class, argv, prog=config_class.__name__, description="", environ={})


async def registered(nc: NatsClient, namespace: str, component: str) -> list[InstanceRecord]:
    """The instances of ``component`` registered right now, as a fresh watcher lists them."""
    return await registered_now(nc.jetstream(), namespace, component)


async def indexed_blocks(nc: NatsClient, namespace: str) -> dict[tuple[int, int], int]:
    """Blocks per (worker, dp rank) in its device cache that the first registered indexer replica
    holds (a rank's offloaded tiers and a worker's pool segment are streams of their own)."""
    address = (await registered(nc, namespace, "indexer"))[0].address
    async with grpc.aio.insecure_channel(address) as channel:
        status = await indexer_pb2_grpc.IndexerStub(channel).GetStatus(indexer_pb2.IndexerStatusRequest(), timeout=5)
    return {(w.worker_id, w.dp_rank): w.blocks for w in status.workers if w.tier in ("", "device")}


def discovered(nats_url: str, component: str, namespace: str = "default") -> list[InstanceRecord]:
    """The instances of ``component`` registered right now (from a synchronous test)."""

    async def read() -> list[InstanceRecord]:
        nc = await nats.connect(nats_url)
        try:
            return await registered(nc, namespace, component)
        finally:
            await nc.close()

    return asyncio.run(read())


def small_context_model(folder: Path, context: int) -> Path:
    """A copy of the tiny model whose context is ``context`` tokens: every request the frontend
    accepts for it is short, so fuzzers can send thousands."""
    model = folder / f"tiny-{context}"
    shutil.copytree(MODEL_DIR, model)
    config_file = model / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "model_max_length": context}))
    return model


async def router_generate(
    router_address: str,
    request_id: str,
    prompt: list[int],
    max_tokens: int = 2,
    worker_id: int | None = None,
    on_output: Callable[[common_pb2.GenerateOutput], None] | None = None,
    model: str = "",
    session: str = "",
    **stop: object,
) -> list[common_pb2.GenerateOutput]:
    """Every output of one request served on the request path through the router at
    ``router_address`` (``worker_id``: send it there; ``on_output``: told of each output as it
    comes; ``model``: the model asked for, any by default; ``session``: the session it names, none by
    default; ``stop``: more ``StopConditions`` fields). Raises ``grpc.aio.AioRpcError`` as the path does."""
    from kvmesh.common.calling.request_path import RequestPath
    from kvmesh.common.calling.router_client import RouterClient

    request = common_pb2.PreprocessedRequest(request_id=request_id, token_ids=prompt, model=model)
    request.stop.max_tokens = max_tokens
    for name, value in stop.items():
        setattr(request.stop, name, value)
    if worker_id is not None:
        request.routing.worker_id = worker_id
    request.routing.session_id = session
    routers = RouterClient(fixed_address=router_address)
    path = RequestPath(routers)
    outputs = []
    try:
        async for output in path.generate(request):
            outputs.append(output)
            if on_output is not None:
                on_output(output)
        return outputs
    finally:
        await path.close()
        await routers.close()


@dataclass
class WorkerMesh:
    """A mesh of worker processes behind an in-process indexer and router (:func:`worker_mesh`)."""

    router: str  # addresses
    indexer: str
    processes: list[subprocess.Popen[bytes]]
    workers: DiscoveryWatcher


@contextlib.asynccontextmanager
async def worker_mesh(
    nc: NatsClient,
    nats_url: str,
    namespace: str,
    worker_flags: tuple[str, ...] = (),
    workers: int = 2,
    router_flags: tuple[str, ...] = (),
) -> AsyncIterator[WorkerMesh]:
    """An indexer and a router (in this process, the router with ``router_flags``) and ``workers``
    worker processes started with ``worker_flags``, all in ``namespace``, once every one has
    registered; the workers are killed after."""
    from kvmesh.indexer import server as indexer_server
    from kvmesh.indexer.config import IndexerConfig
    from kvmesh.router import server as router_server
    from kvmesh.router.config import RouterConfig

    watchers = {c: DiscoveryWatcher(nc.jetstream(), namespace, c) for c in ("worker", "router", "indexer")}
    for watcher in watchers.values():
        await watcher.start()
    processes = [service_process("worker", nats_url, namespace, *worker_flags) for _ in range(workers)]
    common = ["--nats-url", nats_url, "--namespace", namespace]
    try:
        async with (
            running(indexer_server.serve, service_config(IndexerConfig, common)),
            running(router_server.serve, service_config(RouterConfig, [*common, *router_flags])),
        ):
            await wait_until_async(
                lambda: (
                    len(watchers["worker"].instances()) == workers
                    and watchers["router"].instances()
                    and watchers["indexer"].instances()
                ),
                timeout=30,
                what="up",
            )
            yield WorkerMesh(
                watchers["router"].instances()[0].address,
                watchers["indexer"].instances()[0].address,
                processes,
                watchers["worker"],
            )
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)
        for watcher in watchers.values():
            await watcher.stop()


def scrape(address: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample that the service whose metrics endpoint is ``address`` (``host:port``, its
    registration's ``extra["metrics"]``) exposes now, by sample name (with its suffix, such as
    ``_total``), each with its labels: one read of its /metrics page."""
    page = httpx.get(f"http://{address}/metrics", timeout=10).text
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def metric_samples(address: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples named ``name`` at ``address`` (:func:`scrape`), each with its labels. Empty where it
    has none yet: a labelled counter appears once it counts."""
    return scrape(address).get(name, [])


def metric_value(address: str, name: str, default: float | None = None, **labels: str) -> float:
    """The value of the one sample ``name`` whose labels include ``labels`` at ``address``; ``default``
    where there is none (an AssertionError where no default is given)."""
    values = [value for found, value in metric_samples(address, name) if labels.items() <= found.items()]
    assert len(values) <= 1, f"{name}{labels} matches {len(values)} samples"
    if values:
        return values[0]
    assert default is not None, f"{address} exposes no {name}{labels}"
    return default


async def stored_under_lock(js: JetStreamContext, lock: SnapshotLock, namespace: str) -> Snapshot | None:
    """``namespace``'s stored index snapshot, read while holding its snapshot ``lock`` as a restoring
    replica reads it (None while another holds the lock, or none is stored; then the lock is not
    kept). After a read that found one the lock stays held, so no replica replaces the snapshot or
    purges the stream until the caller releases it. Why: an unlocked read races a snapshotting
    replica, whose replacement of the object stalls a read in progress for a load attempt's timeout
    (5 s, four attempts), and whose purge can pass the snapshot just read."""
    if not await lock.acquire():
        return None
    stored = await snapshots.load(js, namespace)
    if stored is None:
        await lock.release()
    return stored
