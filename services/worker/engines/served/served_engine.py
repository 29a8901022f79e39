"""An engine already running as an OpenAI-compatible server (``vllm serve``, SGLang's server), which
a worker fronts instead of starting one (``kvmesh worker --engine served --engine-url URL``).

What the worker needs of such a server, and where it comes from:

- requests go as token ids (``prompt`` a list of ids on ``/v1/completions``) and tokens come back
  as ids (``return_token_ids``): the frontend's tokenisation stays the only one;
- cached prompt tokens come from the usage of each chunk (``continuous_usage_stats``; vLLM reports
  them when started with ``--enable-prompt-tokens-details``, else they read 0);
- closing a request's HTTP stream is its cancel (vLLM aborts a request whose client went away);
- a connection that fails, or a stream that ends without a finish, fails the request with an
  :class:`EngineFailure`, which the worker answers UNAVAILABLE, so the request migrates;
- the block size and cache size come from vLLM's ``/metrics`` (``vllm:cache_config_info``) unless
  given; the context length from ``/v1/models``;
- the server's KV events come from its ZMQ publisher (``--engine-kv-events``: the endpoint it
  binds, as ``--kv-events-config`` set it), gaps from its replay socket, relayed to JetStream as for
  an in-process vLLM (:class:`~kvmesh.worker.engines.vllm.vllm_events.VllmEventRelay`);
- a request naming a LoRA adapter asks the server for it by name (vLLM: ``--enable-lora
  --lora-modules NAME=PATH``; the worker advertises the names given to ``--lora-adapters``).

Disaggregation (its KV connector) is not driven through such a server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Callable
from typing import Any

import httpx
import structlog

from kvmesh.common.wire.finish_reasons import FinishReason
from kvmesh.common.wire.kv_events import EventData
from kvmesh.worker.engine import (
    EngineFailure,
    EngineRequestError,
    EngineRequestSpec,
    TokenOutput,
    TokenQueue,
)
from kvmesh.worker.engines.streaming_engine import StreamingEngine
from kvmesh.worker.engines.vllm.vllm_events import VllmEventRelay

log = structlog.get_logger(__name__)

_FINISH = {"length": FinishReason.LENGTH, "stop": FinishReason.STOP, "abort": FinishReason.CANCELLED}
_MAX_SEED = (1 << 63) - 1
# how long a request may wait for the server's first byte, and between chunks, before it fails
READ_TIMEOUT_S = 300.0


class ServedEngineError(RuntimeError):
    """The server at the engine URL cannot be used (unreachable, or it does not say what we need)."""


def cache_config(metrics_text: str) -> dict[str, str]:
    """The labels of vLLM's ``vllm:cache_config_info`` gauge (block size, blocks) from its
    ``/metrics`` text; empty when the server exports none."""
    for line in metrics_text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            return dict(re.findall(r'(\w+)="([^"]*)"', line.split("{", 1)[1].rsplit("}", 1)[0]))
    return {}


class ServedEngine(StreamingEngine):
    """Guarantees beyond :class:`StreamingEngine`'s: a request's HTTP stream is closed when it is
    aborted (the server then aborts it); a request the server fails (or a connection that breaks)
    ends its queue with an :class:`EngineFailure`."""

    no_transfer_reason = "an engine behind its own server moves no KV through this worker (no disaggregation)"

    def __init__(
        self,
        url: str,
        deliver_events: Callable[[list[EventData]], None],
        last_event_id: Callable[[], int],
        block_size: int | None = None,
        kv_events: str | None = None,
        kv_replay: str | None = None,
    ) -> None:
        """``url``: the server's OpenAI base (``http://host:port/v1``); ``kv_events`` and
        ``kv_replay``: its ZMQ publisher's and replay socket's endpoints (None: no events, the
        indexers then know nothing of this worker's cache); ``block_size``: its KV block size when
        ``/metrics`` does not say."""
        super().__init__(last_event_id)
        self.url = url.rstrip("/")
        self._deliver_events = deliver_events
        self._kv_events = kv_events
        self._kv_replay = kv_replay
        self.block_size = block_size or 0
        self.max_num_batched_tokens = 8192
        self.served_model = ""
        self._relay: VllmEventRelay | None = None
        self._http: httpx.AsyncClient | None = None

    async def start(self) -> None:
        # no read timeout of its own on streams (a long prompt's first token can take minutes):
        # each request reads with READ_TIMEOUT_S
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=READ_TIMEOUT_S))
        try:
            models = (await self._http.get(f"{self.url}/models")).raise_for_status().json()["data"]
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise ServedEngineError(f"the engine server at {self.url} does not answer /models: {exc}") from exc
        if not models:
            raise ServedEngineError(f"the engine server at {self.url} serves no model")
        self.served_model = models[0]["id"]
        self.max_model_len = int(models[0].get("max_model_len") or 0)
        base = self.url.removesuffix("/v1")
        with contextlib.suppress(httpx.HTTPError):
            config = cache_config((await self._http.get(f"{base}/metrics")).text)
            self.block_size = self.block_size or int(config.get("block_size") or 0)
            self.num_blocks = int(config.get("num_gpu_blocks") or 0)
        if not self.block_size:
            raise ServedEngineError(
                f"the engine server at {self.url} does not say its KV block size (no vllm:cache_config_info in "
                "/metrics): give it with --block-size"
            )
        if self._kv_events:
            self._relay = VllmEventRelay(
                self._kv_events, self._kv_replay or "", self._translator, self._deliver_events, connect=True
            )
            await self._relay.start()
        log.info(
            "fronting an engine server",
            url=self.url,
            model=self.served_model,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            kv_events=self._kv_events,
        )

    async def stop(self) -> None:
        await self._end_requests()
        if self._relay is not None:
            await self._relay.stop()
        if self._http is not None:
            await self._http.aclose()

    def submit(
        self, spec: EngineRequestSpec, hold_on_finish: bool = False, kv_transfer_params: dict[str, Any] | None = None
    ) -> TokenQueue:
        if hold_on_finish or kv_transfer_params:
            raise EngineRequestError(self.no_transfer_reason)
        return self._run(spec, lambda queue: self._generate(spec, queue))

    def body(self, spec: EngineRequestSpec) -> dict[str, Any]:
        """The ``/v1/completions`` request for ``spec``."""
        body: dict[str, Any] = {
            # an adapter the server loaded is asked for by its name (vLLM's --lora-modules NAME=PATH)
            "model": spec.lora_name or self.served_model,
            "prompt": list(spec.prompt),
            "max_tokens": spec.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "return_token_ids": True,
            "ignore_eos": spec.ignore_eos,
            "stop_token_ids": list(spec.stop_token_ids),
        }
        if spec.temperature is not None:
            body["temperature"] = spec.temperature
        if spec.top_p is not None:
            body["top_p"] = spec.top_p
        if spec.seed is not None:
            body["seed"] = spec.seed & _MAX_SEED
        return body

    async def _generate(self, spec: EngineRequestSpec, queue: TokenQueue) -> None:
        assert self._http is not None
        cached = 0
        try:
            # cancelling this task closes the stream: the server aborts the request
            request = self._http.stream(
                "POST", f"{self.url}/completions", json=self.body(spec), headers={"X-Request-Id": spec.request_id}
            )
            async with request as response:
                if response.status_code >= 400:
                    text = (await response.aread()).decode(errors="replace")[:300]
                    queue.put_nowait(EngineFailure(f"the engine server answered {response.status_code}: {text}"))
                    return
                # the finish comes before the usage that says the cached tokens (a chunk of its
                # own): the last output waits for it, or for the stream's end
                finish: FinishReason | None = None
                last: int | None = None
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        break
                    chunk = json.loads(line[6:])
                    if "error" in chunk:  # an error after the stream began (vLLM answers 200 first)
                        message = (chunk["error"] or {}).get("message", chunk["error"])
                        queue.put_nowait(EngineFailure(f"the engine server failed the request: {message}"))
                        return
                    usage = chunk.get("usage") or {}
                    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or cached)
                    for choice in chunk.get("choices") or ():
                        tokens = list(choice.get("token_ids") or ())
                        reason = choice.get("finish_reason")
                        if reason:
                            finish = _FINISH.get(reason, FinishReason.STOP)
                            last = tokens.pop() if tokens else None
                        for token in tokens:
                            queue.put_nowait(TokenOutput(spec.request_id, token, None, cached))
                if finish is not None:
                    queue.put_nowait(TokenOutput(spec.request_id, last, finish, cached))
                    return
            queue.put_nowait(EngineFailure("the engine server ended the request's stream without finishing it"))
        except asyncio.CancelledError:
            raise
        except (httpx.HTTPError, ValueError) as exc:
            log.warning(
                "engine server request failed", request_id=spec.request_id, error=f"{type(exc).__name__}: {exc}"
            )
            queue.put_nowait(EngineFailure(f"the engine server failed the request: {type(exc).__name__}: {exc}"))

    @property
    def relay(self) -> VllmEventRelay | None:
        return self._relay
