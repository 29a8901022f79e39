"""OpenAI response bodies for one request: a whole completion as JSON, or server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import structlog
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvmesh.common.wire.requests import WORKER_ID_HEADER
from kvmesh.frontend.answer_chunks import AnswerChunks, sse_event
from kvmesh.frontend.errors import OpenAIError, UpstreamError
from kvmesh.frontend.event_stream import EventStreamResponse
from kvmesh.frontend.gateway import Frontend, UsageCounter
from kvmesh.frontend.protocol import ChatCompletionRequest, CompletionRequest

log = structlog.get_logger(__name__)


# How often a non-streaming request checks that its client is still there.
DISCONNECT_POLL_SECS = 0.5
# nginx's "client closed request": logged and counted, never seen by the client (it is gone).
CLIENT_CLOSED_REQUEST = 499


async def respond(
    frontend: Frontend,
    body: ChatCompletionRequest | CompletionRequest,
    token_ids: list[int],
    chat: bool,
    http_request: Request,
) -> Response:
    """Answer ``body`` as one JSON body or as server-sent events. Either way a client that goes away
    cancels the request everywhere (router, worker, engine): a streaming response stops when the
    server cannot write to it; a non-streaming one watches the connection while it waits."""
    priority, session = frontend.routing_hints(body, http_request.headers)
    if body.stream:
        return await _respond(frontend, body, token_ids, chat, priority, session)
    answer = asyncio.create_task(_respond(frontend, body, token_ids, chat, priority, session))
    while True:
        done, _ = await asyncio.wait({answer}, timeout=DISCONNECT_POLL_SECS)
        if done:
            return answer.result()
        if await http_request.is_disconnected():
            answer.cancel()  # closes the router call, which cancels the request downstream
            with contextlib.suppress(asyncio.CancelledError):
                await answer
            log.info("client went away; request cancelled")
            return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _respond(
    frontend: Frontend,
    body: ChatCompletionRequest | CompletionRequest,
    token_ids: list[int],
    chat: bool,
    priority: str | None = None,
    session: str = "",
) -> Response:
    prefix = "chatcmpl" if chat else "cmpl"
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    structlog.contextvars.bind_contextvars(request_id=request_id)
    started = time.monotonic()
    created = int(time.time())
    usage = UsageCounter(prompt_tokens=len(token_ids))
    request = frontend.build_request(request_id, body, token_ids, priority, session)
    frontend.load.arrived()
    stop = body.stop_strings()
    # an answer sent whole needs its pieces only at the end, unless a stop string may cut it short
    pieces = frontend.generate(request, stop, usage, whole=not body.stream and not stop)
    # Wait for the first piece before answering, so routing errors still get their HTTP status.
    try:
        first = await anext(pieces)
    except StopAsyncIteration as exc:
        raise UpstreamError("the router returned no output") from exc
    first_token = time.monotonic()
    frontend.metrics.ttft.observe(first_token - started)
    log.info("first token", prompt_tokens=len(token_ids), ttft_ms=round((first_token - started) * 1000, 2))

    def finished() -> None:
        ended = time.monotonic()
        frontend.metrics.latency.observe(ended - started)
        frontend.load.finished(
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.cached_tokens,
            first_token - started,
            ended - first_token,
        )
        frontend.metrics.prompt_tokens.inc(usage.prompt_tokens)
        frontend.metrics.cached_tokens.inc(usage.cached_tokens)
        log.info("request done", completion_tokens=usage.completion_tokens, cached_tokens=usage.cached_tokens)

    if not body.stream:
        text = [first.text]
        finish = first.finish_reason
        try:
            async for piece in pieces:
                text.append(piece.text)
                finish = piece.finish_reason or finish
        finally:
            await pieces.aclose()  # at once when cancelled: the router call ends with it
        finished()
        content = "".join(text)
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": finish,
                "logprobs": None,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": content, "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        return JSONResponse(
            {
                "id": request_id,
                "object": obj,
                "created": created,
                "model": body.model,
                "choices": [choice],
                "usage": usage.body(),
            },
            headers=_served_by(usage),
        )

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunks = AnswerChunks(request_id, body.model, created, chat, include_usage)

    async def events() -> AsyncIterator[bytes]:
        try:
            yield chunks.event(first.text, first.finish_reason, first=True)
            async for piece in pieces:
                yield chunks.event(piece.text, piece.finish_reason)
            if include_usage:
                yield chunks.usage_event(usage.body())
            finished()
            yield b"data: [DONE]\n\n"
        except OpenAIError as exc:
            log.warning("stream failed", error=exc.message)
            yield sse_event(exc.body())
            yield b"data: [DONE]\n\n"
        finally:
            await pieces.aclose()

    return EventStreamResponse(events(), headers=_served_by(usage))


def _served_by(usage: UsageCounter) -> dict[str, str]:
    """Response headers naming the worker that served the request (known once the first token came)."""
    return {WORKER_ID_HEADER: str(usage.worker_id)} if usage.worker_id is not None else {}
