"""Profile a running worker (mock or vLLM) over its gRPC API: the same measurements as the mock
profile, taken in real time through ``Worker.Generate`` with prompts no cache holds."""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import time
from collections.abc import Sequence

import grpc

from kvmesh.common.core.engine_profile import DecodePoint, EngineProfile, PrefillPoint
from kvmesh.common.proto.kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvmesh.common.rpc.grpc_server import channel_to

PREFILL_TOKENS = (128, 512, 1024, 2048, 4096, 8192)
CONCURRENCY = (1, 4, 16)
CONTEXT_TOKENS = (256, 1024, 4096)
REPEATS = 3
DECODE_TOKENS = 24


class LiveProfiler:
    """Measures one worker; every prompt is fresh random tokens, so nothing comes from its cache."""

    def __init__(self, address: str, vocab_size: int, max_prompt_tokens: int, seed: int = 0) -> None:
        self.address = address
        self.vocab_size = vocab_size
        self.max_prompt_tokens = max_prompt_tokens
        self._rng = random.Random(seed)
        self._ids = 0

    def _request(self, length: int, max_tokens: int) -> common_pb2.PreprocessedRequest:
        self._ids += 1
        tokens = [self._rng.randrange(1, self.vocab_size) for _ in range(length)]
        request = common_pb2.PreprocessedRequest(request_id=f"profile-{self._ids}", token_ids=tokens)
        request.stop.max_tokens = max_tokens
        request.stop.ignore_eos = True
        return request

    async def _stream(self, stub, request) -> list[float]:
        """Arrival times (s, monotonic) of each output, starting with the send."""
        times = [time.monotonic()]
        async for _output in stub.Generate(request, timeout=600):
            times.append(time.monotonic())
        return times

    async def measure(
        self,
        prefill_tokens: Sequence[int] = PREFILL_TOKENS,
        concurrency: Sequence[int] = CONCURRENCY,
        context_tokens: Sequence[int] = CONTEXT_TOKENS,
    ) -> EngineProfile:
        async with channel_to(self.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            status = await stub.GetStatus(worker_pb2.WorkerStatusRequest(), timeout=30)
            capacity = status.total_blocks * status.block_size
            await self._stream(stub, self._request(16, 2))  # warm-up: first calls pay set-up costs
            prefill = []
            for length in (n for n in prefill_tokens if n <= self.max_prompt_tokens):
                runs = [await self._stream(stub, self._request(length, 1)) for _ in range(REPEATS)]
                prefill.append(PrefillPoint(length, statistics.median((t[1] - t[0]) * 1000 for t in runs)))
            decode = []
            for c in concurrency:
                for length in context_tokens:
                    if length + DECODE_TOKENS > self.max_prompt_tokens or c * (length + DECODE_TOKENS) > capacity:
                        continue
                    streams = await asyncio.gather(
                        *(self._stream(stub, self._request(length, DECODE_TOKENS)) for _ in range(c))
                    )
                    # gaps after every stream's first token: all of them decoding together
                    start = max(t[1] for t in streams)
                    gaps = [b - a for t in streams for a, b in itertools.pairwise(t[1:]) if a >= start]
                    if gaps:
                        decode.append(DecodePoint(c, length, statistics.mean(gaps) * 1000))
        return EngineProfile(
            engine="live",
            prefill=tuple(prefill),
            decode=tuple(decode),
            max_num_batched_tokens=0,  # not visible over the API; chunking shows in the TTFT points
            capacity_tokens=capacity,
            notes={"worker": self.address, "model": status.model, "block_size": status.block_size},
        )


async def profile_worker(address: str, vocab_size: int, max_prompt_tokens: int) -> EngineProfile:
    try:
        return await LiveProfiler(address, vocab_size, max_prompt_tokens).measure()
    except grpc.aio.AioRpcError as exc:
        raise SystemExit(f"kvmesh profile: worker {address} failed: {exc.code().name}: {exc.details()}") from exc
