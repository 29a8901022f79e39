"""The one interface a worker's inference engine implements, and the types that cross it.

The worker's gRPC servicer talks to an :class:`Engine` only: it submits a request
(:class:`EngineRequestSpec`) and reads its tokens from a queue, reserves memory for a prompt whose
KV arrives from another worker, hands a finished prefill's KV over, aborts, and reads
:class:`EngineStatus` and the cached blocks for ``GetStatus``, ``DumpKvState`` and the metrics.
The mock engine (:class:`~kvmesh.worker.engines.mock.engine_loop.MockEngineLoop`) implements it; a real engine
slots in beside it without touching the server.
"""

from __future__ import annotations

import abc
import asyncio
import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvmesh.common.core.timing import TimingModel
from kvmesh.common.core.timing_fit import TimingEvidence
from kvmesh.common.proto.kvmesh.v1 import common_pb2
from kvmesh.common.wire.finish_reasons import FinishReason
from kvmesh.common.wire.hashing import token_array
from kvmesh.common.wire.requests import DEFAULT_MAX_TOKENS


class EngineRequestError(ValueError):
    """A request the engine can never serve (for instance a prompt larger than the whole cache)."""


@dataclass(frozen=True)
class EngineRequestSpec:
    """What the caller asks of the engine for one request."""

    request_id: str
    prompt: Sequence[int]
    max_tokens: int
    stop_token_ids: Sequence[int] = ()
    seed: int | None = None  # None: the engine's own randomness
    lora_name: str | None = None
    temperature: float | None = None  # None: the engine's default
    top_p: float | None = None
    ignore_eos: bool = False

    @classmethod
    def from_proto(cls, request: common_pb2.PreprocessedRequest) -> EngineRequestSpec:
        sampling = request.sampling
        return cls(
            request_id=request.request_id,
            prompt=token_array(request.token_ids),
            max_tokens=request.stop.max_tokens or DEFAULT_MAX_TOKENS,
            stop_token_ids=tuple(request.stop.stop_token_ids),
            seed=sampling.seed if sampling.HasField("seed") else None,
            lora_name=request.lora_name if request.HasField("lora_name") else None,
            temperature=sampling.temperature if sampling.HasField("temperature") else None,
            top_p=sampling.top_p if sampling.HasField("top_p") else None,
            ignore_eos=request.stop.ignore_eos,
        )


@dataclass(frozen=True)
class TokenOutput:
    """A token produced for a request in one step; ``finish_reason`` is set on its last one.
    ``token_id`` is None only on a last output that carries no new token (the engine stopped)."""

    request_id: str
    token_id: int | None
    finish_reason: FinishReason | None
    cached_tokens: int
    # on the last output of a held prefill, from an engine with its own KV connector: where its KV waits
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(frozen=True)
class EngineFailure:
    """Put in a request's queue instead of its next token when the engine failed it (engine dead,
    internal error); the request is over."""

    message: str


@dataclass(frozen=True)
class TransferPlan:
    """Where a remote prefill's KV lands: blocks ``first_block`` … ``first_block + len(slots) - 1`` of
    the prompt go into these slots; the blocks before ``first_block`` are already cached here."""

    first_block: int
    slots: list[int]
    sequence_hashes: list[int]

    @property
    def num_blocks(self) -> int:
        return len(self.slots)


@dataclass(frozen=True)
class EngineStatus:
    """The engine's memory and queues right now."""

    block_size: int
    total_blocks: int
    cached_blocks: int
    active_blocks: int
    running_requests: int
    waiting_requests: int
    held_prefills: int


class TokenQueue:
    """A request's outputs, in order, for its one reader: tokens, the last with a finish reason, or
    an :class:`EngineFailure`.

    Guarantees: :meth:`get` returns the items in the order put; after :meth:`hold_until_last` it
    returns only once the last output or a failure is queued, and the outputs before it wait here
    (taken with :meth:`get_nowait`). A whole answer needs nothing of its outputs between its first
    and its last (docs/decisions/0026), so its reader then wakes once instead of once per engine
    step. Why not an ``asyncio.Queue``: it cannot wait for a kind of item, and its per-call loop
    checks and waiter list cost more than one reader needs (docs/decisions/0019).
    """

    __slots__ = ("_hold", "_items", "_last_queued", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque[TokenOutput | EngineFailure] = collections.deque()
        self._last_queued = False
        self._hold = False
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: TokenOutput | EngineFailure) -> None:
        self._items.append(item)
        if isinstance(item, EngineFailure) or item.finish_reason is not None:
            self._last_queued = True
        elif self._hold:
            return  # the reader waits for the last one
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> TokenOutput | EngineFailure:
        # One wait is enough: put_nowait wakes the reader only once what it waits for is queued.
        if not self._items or (self._hold and not self._last_queued):
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def get_nowait(self) -> TokenOutput | EngineFailure:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def wait_for_item(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until an item is queued, without taking it; whether one is."""
        if self._items:
            return True
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except TimeoutError:
            return False
        finally:
            self._waiter = None
        return True

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    def hold_until_last(self) -> None:
        """From now on :meth:`get` waits for the last output or a failure."""
        self._hold = True

    @property
    def holding(self) -> bool:
        """Whether :meth:`hold_until_last` was called."""
        return self._hold


def take_ready(queue: TokenQueue, first: TokenOutput) -> tuple[TokenOutput, list[int], EngineFailure | None]:
    """``first`` and every output the engine has already queued behind it, up to a last one:
    (the latest output, their token ids in order, a failure met behind them). One streamed message
    then carries what a reader that fell behind would otherwise take one message per token for,
    through every hop to the client; a reader that keeps up still gets each token alone, at once."""
    output, tokens = first, [] if first.token_id is None else [first.token_id]
    while output.finish_reason is None and not queue.empty():
        ready = queue.get_nowait()
        if isinstance(ready, EngineFailure):
            return output, tokens, ready
        output = ready
        if output.token_id is not None:
            tokens.append(output.token_id)
    return output, tokens, None


class CachedBlock(NamedTuple):
    """One block the engine's prefix cache holds, as ``DumpKvState`` reports it."""

    block_hash: int  # the engine's own id (parent links and removals use it)
    tokens_hash: int  # our local hash of the block's tokens (DESIGN §2)
    parent_hash: int | None  # the engine id of the block before it
    sequence_hash: int  # our hash of the block and its whole prefix


def transferable_blocks(prompt_tokens: int, block_size: int) -> int:
    """Full prompt blocks a decode worker takes from a remote prefill. At least one prompt token is
    always left to compute locally, since the step that computes it samples the first output token
    (vLLM's decode side recomputes the last prompt token for the same reason)."""
    return max(0, (prompt_tokens - 1) // block_size)


class Engine(abc.ABC):
    """An inference engine behind a worker. Guarantees callers can rely on:

    - every submitted request's queue receives its tokens in order, the last one with a finish
      reason, unless the request is aborted first;
    - ``abort`` frees whatever the request holds, wherever it is (idempotent);
    - KV events describe exactly what the cache did, and ``dump_kv_state`` is consistent with the
      events numbered up to the id it returns.
    """

    block_size: int
    max_num_batched_tokens: int  # tokens one engine step takes at most (the router's cost model reads it)

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def stop(self) -> None: ...

    @abc.abstractmethod
    def submit(
        self, spec: EngineRequestSpec, hold_on_finish: bool = False, kv_transfer_params: dict[str, Any] | None = None
    ) -> TokenQueue:
        """Queue a request; ``hold_on_finish`` keeps its KV after the last token, for a transfer,
        until :meth:`release_held`; ``kv_transfer_params`` (engines with their own KV connector) say
        where its prompt's KV is to be pulled from. Raises :class:`EngineRequestError` for one it can
        never serve."""

    @abc.abstractmethod
    def reserve_remote(self, spec: EngineRequestSpec) -> tuple[TransferPlan | None, TokenQueue]:
        """Reserve memory for a prompt whose KV another worker computed (None: no room; nothing was
        queued then). Call :meth:`finish_transfer` when the transfer ends."""

    @abc.abstractmethod
    def finish_transfer(self, request_id: str, received: bool) -> None:
        """The KV of a reserved request arrived (run it from there) or did not (prefill it here)."""

    @abc.abstractmethod
    def held_slots(self, request_id: str, num_blocks: int) -> list[int]:
        """The KV slots of the first ``num_blocks`` blocks of a finished, held prefill."""

    @abc.abstractmethod
    def release_held(self, request_id: str) -> None:
        """Drop a held prefill's KV (transferred, or nobody came for it)."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None: ...

    @abc.abstractmethod
    def status(self) -> EngineStatus: ...

    def fitted_timing(self) -> TimingModel | None:
        """The step-time model fitted from the steps this engine ran (None before any), which the
        worker advertises for the router's ttft cost."""
        return None

    # What engines alike in speed have in common (its build and device), advertised for the routers:
    # they cost a model's workers of one class at one speed (docs/decisions/0062). None: unknown.
    speed_class: str | None = None

    def timing_evidence(self) -> TimingEvidence | None:
        """The steps behind :meth:`fitted_timing`, which the worker advertises too: the router pools
        a fleet's steps (docs/decisions/0061). None before any step, or for an engine that fits none."""
        return None

    @abc.abstractmethod
    def dump_kv_state(self) -> tuple[int, list[CachedBlock]]:
        """(last KV event id published, every cached block) as one consistent picture."""

    # ---- cached blocks moved between workers (docs/decisions/0051) -----------------------------
    moves_blocks = False  # whether the methods below work (the mock engine's do)

    def hot_blocks(self, limit: int) -> list[tuple[int, int, int | None]]:
        """About ``limit`` of the hottest cached blocks, each with its cached ancestors, parents first:
        (sequence hash, local hash, parent sequence hash)."""
        raise EngineRequestError("this engine cannot move its cached blocks")

    def cached_prefix(self, sequence_hashes: list[int]) -> list[tuple[int, int, int | None]]:
        """The first of these blocks that are cached, up to the first that is not, as
        :meth:`hot_blocks` lists them: what another worker can pull of a prompt's prefix."""
        raise EngineRequestError("this engine cannot move its cached blocks")

    def offer_blocks(self, offer_id: str, sequence_hashes: list[int]) -> list[tuple[int, int]]:
        """Hold these cached blocks for another worker until :meth:`release_held` ``offer_id``:
        (sequence hash, KV slot) of each, in order (a block no longer cached is left out)."""
        raise EngineRequestError("this engine cannot move its cached blocks")

    def reserve_intake(self, intake_id: str, blocks: list[tuple[int, int, int | None]]) -> list[int]:
        """Slots for the first of another worker's offered ``blocks``, as many as fit now."""
        raise EngineRequestError("this engine cannot move its cached blocks")

    def finish_intake(self, intake_id: str, received: bool) -> int:
        """Cache the reserved blocks (their bytes arrived) or give them back; how many were cached."""
        raise EngineRequestError("this engine cannot move its cached blocks")

    def dump_pool_state(self) -> tuple[int, list[CachedBlock]] | None:
        """The same for the worker's KV pool segment (its ``pooled`` stream); None without one."""
        return None

    def dump_tier_state(self, tier: str) -> tuple[int, list[CachedBlock]] | None:
        """The same for one of this engine instance's offloaded tiers (``host``, ``disk``: streams of
        their own); None without it."""
        return None
