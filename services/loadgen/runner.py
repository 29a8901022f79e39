"""Sends a workload to an OpenAI-compatible endpoint with streaming, and times every token."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import openai

from kvmesh.common.wire.priority import PRIORITY_HEADER  # kvmesh's; other servers ignore it
from kvmesh.common.wire.requests import WORKER_ID_HEADER  # kvmesh's; other servers send none
from kvmesh.common.wire.session import SESSION_HEADERS
from kvmesh.loadgen.workload import BenchRequest


@dataclass
class RequestResult:
    """Timings of one request, in seconds from the start of the run."""

    index: int
    sent_s: float
    prompt_tokens: int
    first_token_s: float | None = None
    done_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    status: int | None = None  # the HTTP status of a refusal (429, 503, ...)
    retry_after: str | None = None  # its Retry-After header
    priority: str = ""
    worker_id: str | None = None  # the worker that served it (the frontend's x-kvmesh-worker-id header)

    @property
    def ttft_s(self) -> float | None:
        """From sending to the first chunk with text, or to the answer's end where no chunk had any."""
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.done_s is None else self.done_s - self.sent_s

    @property
    def inter_token_s(self) -> list[float]:
        times = self.chunk_times_s
        return [b - a for a, b in itertools.pairwise(times)]


class LoadRunner:
    """Runs a workload open-loop (each request at its ``send_at_s`` or at a fixed rate) or closed-loop
    (``concurrency`` clients back to back). Errors are recorded per request, never raised.

    A request with ``after`` is sent no earlier than that request's answer (and the caching of its
    reply); one with ``reply_prompt`` then has that prompt prefilled, one output token, on the
    worker its answer named (``x-kvmesh-worker-id``), or not at all where none was named: see
    :mod:`kvmesh.loadgen.session_turns`. Those prefills are kept in :attr:`replies`, apart from the
    measured requests."""

    def __init__(
        self,
        client: openai.AsyncOpenAI,
        model: str,
        endpoint: str = "completions",
        on_done: Callable[[RequestResult], None] | None = None,
    ) -> None:
        if endpoint not in ("completions", "chat"):
            raise ValueError("endpoint must be 'completions' or 'chat'")
        self.client = client
        self.model = model
        self.endpoint = endpoint
        self._on_done = on_done
        self._start = 0.0
        self._settled: dict[int, asyncio.Event] = {}
        self.replies: list[RequestResult] = []  # the reply prefills: not measured, kept to count failures

    def _now(self) -> float:
        return time.perf_counter() - self._start

    async def run(
        self,
        requests: Sequence[BenchRequest],
        request_rate: float | None = None,
        concurrency: int | None = None,
    ) -> list[RequestResult]:
        self._start = time.perf_counter()
        # one event per request a later one waits for (one missing from ``requests`` holds nobody up)
        sent = {request.index for request in requests}
        self._settled = {r.after: asyncio.Event() for r in requests if r.after is not None and r.after in sent}
        self.replies = []
        if concurrency is not None:
            return await self._closed_loop(requests, concurrency)
        tasks = []
        for position, request in enumerate(requests):
            send_at = position / request_rate if request_rate else (request.send_at_s or 0.0)
            delay = send_at - self._now()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self._turn(request)))
        return list(await asyncio.gather(*tasks))

    async def _closed_loop(self, requests: Sequence[BenchRequest], concurrency: int) -> list[RequestResult]:
        queue = iter(requests)
        results: list[RequestResult] = []

        async def client_loop() -> None:
            for request in queue:
                results.append(await self._turn(request))

        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        return sorted(results, key=lambda r: r.index)

    async def _turn(self, request: BenchRequest) -> RequestResult:
        """``request`` sent once its predecessor has settled; then its reply cached, if it has one.
        Its own settling is signalled whatever happens, so no later turn waits forever."""
        try:
            predecessor = self._settled.get(request.after) if request.after is not None else None
            if predecessor is not None:
                await predecessor.wait()
            result = await self._send(request)
            if request.reply_prompt and result.error is None and result.worker_id is not None:
                await self._cache_reply(request, int(result.worker_id))
            return result
        finally:
            settled = self._settled.get(request.index)
            if settled is not None:
                settled.set()

    async def _cache_reply(self, request: BenchRequest, worker_id: int) -> None:
        """Prefill ``request``'s context through its reply on ``worker_id`` (one output token)."""
        reply = RequestResult(request.index, self._now(), 0, worker_id=str(worker_id))
        common = {"model": self.model, "max_tokens": 1, "extra_body": {"kvmesh": {"worker_id": worker_id}}}
        try:
            answer = await self._create(request.reply_prompt, common)
            if answer.usage is not None:
                reply.prompt_tokens = answer.usage.prompt_tokens
            reply.done_s = self._now()
        except openai.APIError as exc:
            reply.error = f"{type(exc).__name__}: {exc}"
        self.replies.append(reply)

    async def _create(self, prompt: str, options: dict[str, Any]) -> Any:
        """``prompt`` sent to this runner's endpoint, as the one user message of a chat or as a
        completion's prompt, with ``options``; the client's answer (a stream where asked for)."""
        if self.endpoint == "chat":
            return await self.client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **options)
        return await self.client.completions.create(prompt=prompt, **options)

    async def _send(self, request: BenchRequest) -> RequestResult:
        result = RequestResult(request.index, self._now(), request.prompt_tokens, priority=request.priority)
        common = {
            "model": self.model,
            "max_tokens": request.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {PRIORITY_HEADER: request.priority} if request.priority else {}
        if request.session:  # a session-structured trace's: the router keeps its turns together
            headers[SESSION_HEADERS[0]] = request.session
        if headers:
            common["extra_headers"] = headers
        try:
            stream = await self._create(request.prompt, common)
            result.worker_id = stream.response.headers.get(WORKER_ID_HEADER)
            async for chunk in stream:
                if chunk.choices:
                    choice = chunk.choices[0]
                    text = choice.delta.content if self.endpoint == "chat" else choice.text
                    if text or (choice.finish_reason and result.first_token_s is None):
                        # An answer whose tokens all decode to no text (a random-weight model's can)
                        # is first heard of at its end: its TTFT is then, not missing, as leaving it
                        # out would drop slow requests from the percentiles.
                        now = self._now()
                        if result.first_token_s is None:
                            result.first_token_s = now
                        if text:
                            result.chunk_times_s.append(now)
                if chunk.usage is not None:
                    result.output_tokens = chunk.usage.completion_tokens
                    result.prompt_tokens = chunk.usage.prompt_tokens
                    details = chunk.usage.prompt_tokens_details
                    result.cached_tokens = (details.cached_tokens or 0) if details else 0
            result.done_s = self._now()
            if not result.output_tokens:
                result.output_tokens = len(result.chunk_times_s)
        except openai.APIError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, openai.APIStatusError):
                result.status = exc.status_code
                result.retry_after = exc.response.headers.get("retry-after")
        if self._on_done is not None:
            self._on_done(result)
        return result
