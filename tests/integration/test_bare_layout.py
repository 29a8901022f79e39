"""``bench.bare_layout`` answers a chat completion through every hop of kvmesh's layout.

The bench's figures say what kvmesh's layout costs before kvmesh does any work; they only mean that
if a request really crosses frontend, router, indexer, router, frontend, worker and back (with
``--pattern forward`` or ``forward-answered``: frontend, router, indexer, router, worker, frontend; with
``forward-local``: frontend, router, worker, frontend). A broken hop would show as a hang or an error
here, not as a fast benchmark.
"""

from __future__ import annotations

import openai
import pytest

from bench import bare_layout
from bench.peers import wait_for
from bench.processes import stop_sessions
from kvmesh.common.ports import free_port


@pytest.fixture(params=["none", "mock"])
def engine(request) -> str:
    return request.param


@pytest.fixture(params=bare_layout.PATTERNS)
def pattern(request) -> str:
    return request.param


@pytest.fixture
def base_url(engine: str, pattern: str):
    port = free_port()
    processes = bare_layout.start_all(port, engine=engine, pattern=pattern)
    try:
        # the frontend may listen before its peers do: wait for a first answer
        wait_for(f"http://127.0.0.1:{port}/v1/chat/completions", {"messages": []}, timeout=60)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop_sessions(processes)
        assert all(p.poll() is not None for p in processes)


def test_a_chat_completion_crosses_every_hop(base_url: str, engine: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=5)
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8)
    assert answer.choices[0].message.content == "x" * 8  # the worker's eight tokens, through the frontend
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.prompt_tokens == len(b"hello")
    answers = [
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": str(i)}]) for i in range(20)
    ]
    assert all(a.choices[0].message.content == "x" * 8 for a in answers)
    if engine == "mock":  # the mock engine generates what was asked for, not the fixed eight
        short = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert short.usage.completion_tokens == 3
