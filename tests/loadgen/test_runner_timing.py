"""The load runner's timings, read by the official ``openai`` client from a real HTTP server that
streams what an OpenAI-compatible engine may: text chunks, and chunks whose tokens decode to no text."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest

from kvmesh.loadgen.runner import LoadRunner
from kvmesh.loadgen.workload import BenchRequest
from tests.loadgen.http_server import serving

GAP_S = 0.15  # between the server's chunks: wide enough to tell one chunk's time from the next


def _chunk(text: str, finish_reason: str | None = None) -> dict[str, object]:
    choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m", "choices": [choice]}


# per prompt, the texts of its chunks; the last one finishes the answer
ANSWERS = {"textless": ["", "", ""], "spoken": ["", "a", "b"]}


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        texts = ANSWERS[body["prompt"]]
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        for i, text in enumerate(texts):
            time.sleep(GAP_S)
            chunk = _chunk(text, "length" if i == len(texts) - 1 else None)
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        usage = {"prompt_tokens": 3, "completion_tokens": len(texts), "total_tokens": 3 + len(texts)}
        closing = {**_chunk(""), "choices": [], "usage": usage}
        self.wfile.write(f"data: {json.dumps(closing)}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def engine_url() -> Iterator[str]:
    with serving(ThreadingHTTPServer(("127.0.0.1", 0), _Handler)) as url:
        yield url


def test_an_answer_without_text_gets_its_ttft_at_its_end_and_one_with_text_at_its_first_text(engine_url: str):
    client = openai.AsyncOpenAI(base_url=engine_url, api_key="none", max_retries=0)
    requests = [BenchRequest(i, None, prompt, 3, 3) for i, prompt in enumerate(ANSWERS)]
    results = asyncio.run(LoadRunner(client, "m").run(requests, concurrency=2))
    textless, spoken = results
    assert textless.error is None and spoken.error is None
    # left without a TTFT, such a request would drop out of the percentiles
    assert textless.ttft_s is not None and textless.e2e_s is not None
    assert textless.ttft_s >= 3 * GAP_S * 0.9  # the finishing chunk, not the first empty one
    assert textless.chunk_times_s == [] and textless.output_tokens == 3
    # its first text, not the empty chunk before it (sleeps run no shorter than asked)
    assert spoken.ttft_s is not None and spoken.ttft_s >= 2 * GAP_S * 0.9
    assert len(spoken.chunk_times_s) == 2 and spoken.first_token_s == spoken.chunk_times_s[0]
