"""Prefill/decode disaggregation end to end: ``kvmesh up --prefill-workers 1 --workers 2``, driven
through the OpenAI facade with the official client; KV really moves between worker processes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from kvmesh.common.proto.kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh.common.runtime.discovery import InstanceRecord
from kvmesh.common.wire import disagg
from kvmesh.common.wire.requests import WORKER_ID_HEADER
from kvmesh.devtools.mesh_process import MeshProcess
from kvmesh.worker.kv_transfer.nixl_agent import nixl_available
from tests.e2e.conftest import descendants, start_mesh
from tests.support import discovered, scrape, wait_until

pytestmark = pytest.mark.e2e
MODEL = "kvmesh-tiny"
BLOCK = 16
EXPECTED_BACKEND = "nixl" if nixl_available() else "tcp"


def prompt(topic: str, repeat: int = 12) -> str:
    """A prompt of well over 512 tokens (one byte-level token per character), unique per topic."""
    return f"[{topic}] " + "Prefill and decode run on different workers; the KV cache moves between them. " * repeat


@pytest.fixture(scope="module")
def bootstrap_mesh() -> Iterator[MeshProcess]:
    yield from start_mesh("--prefill-workers", "1", "--workers", "2", *SPLIT)


@pytest.fixture(scope="module")
def sync_mesh() -> Iterator[MeshProcess]:
    yield from start_mesh("--prefill-workers", "1", "--workers", "2", "--kv-handoff", "sync", *SPLIT)


def client(mesh: MeshProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.api, api_key="unused", max_retries=0, timeout=60)


def chat(mesh: MeshProcess, content: str, **kwargs):
    raw = client(mesh).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **kwargs
    )
    return raw.parse(), int(raw.headers[WORKER_ID_HEADER])


def instances(mesh: MeshProcess, component: str) -> list[InstanceRecord]:
    return discovered(mesh.nats_url, component)


Sample = tuple[str, frozenset[tuple[str, str]]]


def sample(name: str, **labels: str) -> Sample:
    """The key of a sample in :func:`router_metrics`: its name and its labels."""
    return name, frozenset(labels.items())


def router_metrics(mesh: MeshProcess) -> dict[Sample, float]:
    """The router's kvmesh_router_prefills / kv_transfer_bytes samples, by :func:`sample`."""
    page = scrape(instances(mesh, "router")[0].extra["metrics"])
    return {
        sample(name, **labels): value
        for name in ("kvmesh_router_prefills_total", "kvmesh_router_kv_transfer_bytes_total")
        for labels, value in page.get(name, [])
    }


# these tests are about the split itself: every request that may split does (not only where it pays)
SPLIT = ("--disagg-split-when", "always")
REMOTE = sample("kvmesh_router_prefills_total", reason="", where="remote")
BELOW = sample("kvmesh_router_prefills_total", reason="below_threshold", where="local")
BYTES = sample("kvmesh_router_kv_transfer_bytes_total", backend=EXPECTED_BACKEND)


def remote_prefill_and_identical_output(mesh: MeshProcess, topic: str) -> None:
    before = router_metrics(mesh)
    text = prompt(topic)
    answer, decode_worker = chat(mesh, text, max_tokens=12, seed=5)
    after = router_metrics(mesh)
    assert after.get(REMOTE, 0) == before.get(REMOTE, 0) + 1
    assert after.get(BYTES, 0) > before.get(BYTES, 0)  # real bytes moved, on the expected backend
    roles = {r.instance_id: r.role for r in instances(mesh, "worker")}
    assert roles[decode_worker] == "decode"
    assert answer.usage.completion_tokens == 12 and answer.choices[0].finish_reason == "length"

    # the same request served whole by one worker (forced, so not disaggregated) answers the same
    aggregated, forced_worker = chat(
        mesh, text, max_tokens=12, seed=5, extra_body={"kvmesh": {"worker_id": decode_worker}}
    )
    assert forced_worker == decode_worker
    assert aggregated.choices[0].message.content == answer.choices[0].message.content


def test_bootstrap_path_moves_the_kv_and_answers_as_aggregated(bootstrap_mesh):
    remote_prefill_and_identical_output(bootstrap_mesh, "bootstrap")


def test_sync_path_moves_the_kv_and_answers_as_aggregated(sync_mesh):
    remote_prefill_and_identical_output(sync_mesh, "sync")


def test_cached_tokens_of_a_remote_prefill_are_the_prefill_workers(bootstrap_mesh):
    shared = prompt("shared prefix", repeat=8)
    first, _ = chat(bootstrap_mesh, shared, max_tokens=2)
    assert first.usage.prompt_tokens > 512

    found = []

    def reused_remotely() -> bool:
        # KV events reach the indexer asynchronously: retry the extended prompt until the prefill
        # worker's cached prefix is seen (a condition with a timeout, not a sleep)
        before = router_metrics(bootstrap_mesh)
        longer = shared + f" ({len(found)}) " + "and then the answer is decoded token by token. " * 12
        answer, _ = chat(bootstrap_mesh, longer, max_tokens=2)
        found.append(answer)
        remote = router_metrics(bootstrap_mesh).get(REMOTE, 0) > before.get(REMOTE, 0)
        return remote and answer.usage.prompt_tokens_details.cached_tokens >= 8 * BLOCK

    wait_until(reused_remotely, timeout=30, what="a remote prefill reporting the prefill worker's cached prefix")
    answer = found[-1]
    assert answer.usage.prompt_tokens_details.cached_tokens <= answer.usage.prompt_tokens


def test_short_uncached_part_is_prefilled_on_the_decode_worker(bootstrap_mesh):
    before = router_metrics(bootstrap_mesh)
    answer, _ = chat(bootstrap_mesh, "a short question", max_tokens=5)
    after = router_metrics(bootstrap_mesh)
    assert answer.usage.completion_tokens == 5
    assert after.get(BELOW, 0) == before.get(BELOW, 0) + 1
    assert after.get(REMOTE, 0) == before.get(REMOTE, 0)


@pytest.fixture(scope="module")
def enforcing_mesh_without_prefill_workers() -> Iterator[MeshProcess]:
    yield from start_mesh("--workers", "2", "--enforce-disagg")


def test_enforce_disagg_without_prefill_workers_is_a_clear_error(enforcing_mesh_without_prefill_workers):
    with pytest.raises(openai.APIStatusError) as caught:
        chat(enforcing_mesh_without_prefill_workers, prompt("enforced"), max_tokens=3)
    assert caught.value.status_code == 503
    assert "--enforce-disagg" in caught.value.message


def generate_status(address: str, stub_class, request: common_pb2.PreprocessedRequest) -> grpc.StatusCode:
    """The status a streaming Generate call (a worker's) ends with."""

    async def call() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(address) as channel:
            try:
                async for _ in stub_class(channel).Generate(request):
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    return asyncio.run(call())


def test_a_worker_refuses_malformed_disaggregated_params(bootstrap_mesh):
    decode = next(r for r in instances(bootstrap_mesh, "worker") if r.role == "decode")
    request = common_pb2.PreprocessedRequest(request_id="bad", token_ids=[1, 2, 3], disaggregated_params=b"\xc1")
    assert generate_status(decode.address, worker_pb2_grpc.WorkerStub, request) == grpc.StatusCode.INVALID_ARGUMENT


def test_the_router_refuses_disaggregated_params_from_its_caller(bootstrap_mesh):
    """Well-formed decode params (pointing at no prefill worker) would make the decode worker fall
    back and answer; the router refuses them before, since only it may set them."""
    router = instances(bootstrap_mesh, "router")[0]
    params = disagg.encode(disagg.DecodeOrder(room=1, host="127.0.0.1", port=1, worker_id=0))
    request = common_pb2.PreprocessedRequest(
        request_id="own-params", model=MODEL, token_ids=[1, 2, 3], disaggregated_params=params
    )

    async def route_status() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(router.address) as channel:
            try:
                await router_pb2_grpc.RouterStub(channel).Route(router_pb2.RouteRequest(request=request))
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    assert asyncio.run(route_status()) == grpc.StatusCode.INVALID_ARGUMENT
    request.ClearField("disaggregated_params")
    assert asyncio.run(route_status()) == grpc.StatusCode.OK


# ---- a prefill worker killed while it serves a KV transfer ------------------------------------
@pytest.fixture(scope="module")
def heavy_kv_mesh() -> Iterator[MeshProcess]:
    # 64 layers (16 KiB of KV per token) over TCP, so a transfer lasts long enough to be caught in flight
    yield from start_mesh(
        *SPLIT,
        "--prefill-workers",
        "1",
        "--workers",
        "2",
        "--num-layers",
        "64",
        "--num-gpu-blocks-override",
        "2048",
        "--kv-transfer-backend",
        "tcp",
    )


def _prefill_worker_pid(mesh: MeshProcess) -> int:
    """The pid of this mesh's prefill worker (other meshes of this module may still run)."""
    for pid in descendants(mesh.process.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"kvmesh.worker" in cmdline and b"prefill" in cmdline:
            return pid
    raise AssertionError("no prefill worker process found")


def test_prefill_worker_killed_mid_transfer_the_requests_still_complete(heavy_kv_mesh):
    prefill = next(r for r in instances(heavy_kv_mesh, "worker") if r.role == "prefill")
    pid = _prefill_worker_pid(heavy_kv_mesh)

    async def kill_mid_transfer(timeout: float) -> bool:
        """SIGKILL the prefill worker the moment it reports a transfer moving bytes."""
        async with grpc.aio.insecure_channel(prefill.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while loop.time() < deadline:
                status = await stub.GetStatus(worker_pb2.WorkerStatusRequest())
                if status.kv_transfers_in_flight > 0:
                    os.kill(pid, signal.SIGKILL)
                    return True
        return False

    texts = [prompt(f"killed {i}", repeat=40) for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        futures = [pool.submit(chat, heavy_kv_mesh, text, max_tokens=6) for text in texts]
        assert asyncio.run(kill_mid_transfer(60.0)), "no KV transfer was seen in flight"
        answers = [f.result(timeout=120) for f in futures]
    for answer, _worker in answers:
        assert answer.usage.completion_tokens == 6
        assert answer.choices[0].finish_reason == "length"
    metrics = router_metrics(heavy_kv_mesh)
    # a local prefill after the prefill worker failed or its transfer did (prefill_failed, transfer_failed)
    fell_back = sum(
        value
        for (name, labels), value in metrics.items()
        if name == "kvmesh_router_prefills_total"
        and ("where", "local") in labels
        and "failed" in dict(labels)["reason"]
    )
    assert fell_back >= 1, metrics
    # kvmesh up restarts the killed worker: the mesh heals
    wait_until(
        lambda: any(r.role == "prefill" for r in instances(heavy_kv_mesh, "worker")),
        timeout=60,
        what="the prefill worker is back",
    )
