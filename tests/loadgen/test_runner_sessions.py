"""The load runner's session turns (``kvmesh bench --cache-replies``), against a real HTTP server
read by the official ``openai`` client: a turn goes only after its predecessor's answer and reply
prefill, and that prefill goes to the worker the answer named, or nowhere when none was named."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest

from kvmesh.common.wire.requests import WORKER_ID_HEADER
from kvmesh.loadgen.report import reply_summary
from kvmesh.loadgen.runner import LoadRunner
from kvmesh.loadgen.workload import BenchRequest
from tests.loadgen.http_server import serving

ANSWER_S = 0.3  # how long a streamed answer takes: a turn that did not wait would arrive inside it


class _Server(ThreadingHTTPServer):
    worker_id: str | None = None  # the x-kvmesh-worker-id it answers with (None: like another server, none)
    received: list[dict]
    url: str  # its base URL, once serving


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.server.received.append(body)
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        choice = {"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}
        answer = {"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [choice]}
        self.send_response(200)
        if self.server.worker_id is not None:
            self.send_header(WORKER_ID_HEADER, self.server.worker_id)
        if not body.get("stream"):  # a reply prefill
            payload = json.dumps({**answer, "usage": usage}).encode()
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        time.sleep(ANSWER_S)
        closing = {**answer, "choices": [], "usage": usage}
        self.wfile.write(f"data: {json.dumps(answer)}\n\ndata: {json.dumps(closing)}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[_Server]:
    server = _Server(("127.0.0.1", 0), _Handler)
    server.received = []
    with serving(server) as server.url:
        yield server


def run_turns(server: _Server) -> tuple[list[BenchRequest], LoadRunner, list]:
    client = openai.AsyncOpenAI(base_url=server.url, api_key="n", max_retries=0)
    turns = [
        BenchRequest(0, 0.0, "first", 3, 1, session="s", reply_prompt="first reply"),
        BenchRequest(1, 0.0, "second", 3, 1, session="s", after=0),
    ]
    runner = LoadRunner(client, "m")
    return turns, runner, asyncio.run(runner.run(turns))


def test_the_next_turn_waits_for_the_reply_prefilled_on_the_worker_that_answered(server: _Server):
    server.worker_id = "7"
    turns, runner, results = run_turns(server)
    assert [r.error for r in results] == [None, None]
    assert [body["prompt"] for body in server.received] == ["first", "first reply", "second"]
    prefill = server.received[1]
    assert prefill["kvmesh"] == {"worker_id": 7} and prefill["max_tokens"] == 1 and not prefill.get("stream")
    assert results[1].sent_s >= results[0].done_s
    summary = reply_summary(turns, results, runner.replies)
    assert summary == {"wanted": 1, "cached": 1, "failed": 0, "unplaced": 0, "error_examples": []}


def test_an_answer_naming_no_worker_leaves_its_reply_unplaced_and_still_releases_the_next_turn(server: _Server):
    turns, runner, results = run_turns(server)
    assert [body["prompt"] for body in server.received] == ["first", "second"]
    assert results[1].sent_s >= results[0].done_s
    assert runner.replies == []
    assert reply_summary(turns, results, runner.replies)["unplaced"] == 1
