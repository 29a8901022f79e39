"""The mock engine: a continuous-batching scheduler over a real paged KV block pool (sans-I/O).

It models what a vLLM-style engine does with time and memory, without a model:

- each :meth:`MockEngine.step` is one engine iteration with a token budget
  (``max_num_batched_tokens``) and at most ``max_num_seqs`` running sequences;
- running sequences are scheduled before waiting ones (FCFS); a long prompt is prefilled in chunks;
- a sequence's KV needs ``ceil(tokens / block_size)`` blocks; when blocks run out the most recently
  admitted running sequence is preempted (LIFO) and later recomputed;
- a request's prompt prefix already in the cache is not recomputed;
- the step that computes a sequence's last pending token samples its next token, so the first
  token lands at the end of the step that finishes the prefill;
- output tokens are deterministic pseudo-random ids, a function of the seed, the prompt and the
  position (the same request gives the same answer on any worker).

For disaggregation it can also *hold* a finished prefill's blocks for a KV transfer
(``hold_on_finish``), and admit a request whose prompt KV arrives from another worker
(:meth:`MockEngine.add_remote_prefill` reserves the blocks, :meth:`MockEngine.finish_transfer`
hands them over or falls back to a local prefill). Memory is the :class:`KvCacheManager`'s: this
class schedules, that one allocates, registers and (with a :class:`KvBuffer`) fills the blocks.

It never sleeps or does I/O: the caller runs steps, waits ``StepResult.duration_ms`` (really or in
virtual time) and then delivers the step's outputs and KV events.
"""

from __future__ import annotations

import struct
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from kvmesh.common.core.timing import TimingModel
from kvmesh.common.wire.finish_reasons import FinishReason
from kvmesh.common.wire.hashing import blocks_needed, hash_block_tokens
from kvmesh.common.wire.kv_events import EventData, MoePlacement
from kvmesh.worker.engine import (
    EngineRequestError,
    EngineRequestSpec,
    TokenOutput,
    TransferPlan,
    transferable_blocks,
)
from kvmesh.worker.engines.mock import block_moves
from kvmesh.worker.engines.mock.block_manager import BlockManager
from kvmesh.worker.engines.mock.kv_cache_manager import KvCacheManager
from kvmesh.worker.engines.mock.request import EngineRequest
from kvmesh.worker.kv_transfer.kv_buffer import KvBuffer

__all__ = [
    "EngineConfig",
    "EngineRequest",
    "EngineRequestError",
    "EngineRequestSpec",
    "FinishReason",
    "MockEngine",
    "StepResult",
    "TokenOutput",
    "TransferPlan",
    "capacity_refusal",
    "transferable_blocks",
]


def capacity_refusal(num_tokens: int, block_size: int, num_blocks: int) -> str | None:
    """Why a cache of ``num_blocks`` can never hold a request of ``num_tokens`` (prompt + max_tokens),
    or None when it can: the engine refuses such a request, and the replay counts it refused."""
    needed = blocks_needed(num_tokens, block_size)
    if needed > num_blocks:
        return f"prompt + max_tokens needs {needed} KV blocks; this worker has {num_blocks}"
    return None


# Printable ASCII byte ids: with the bundled byte-level tokenizer they decode to readable text.
DEFAULT_OUTPUT_VOCAB: tuple[int, ...] = (*range(97, 123), 32, 32, 32, 46)


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 16384
    block_size: int = 64
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    timing: TimingModel = field(default_factory=TimingModel)
    output_vocab: tuple[int, ...] = DEFAULT_OUTPUT_VOCAB
    # as a mixture-of-experts model: the (layer, expert, group) placements every cached block is tagged with
    moe_placements: tuple[MoePlacement, ...] = ()
    # a host tier of this many blocks takes evicted blocks (0: none); reloading one costs this per token
    host_blocks: int = 0
    host_reload_ms_per_token: float = 0.002


@dataclass(frozen=True)
class StepResult:
    duration_ms: float
    outputs: list[TokenOutput]
    prefill_tokens: int
    decoding_requests: int
    decode_context_tokens: int = 0


class MockEngine:
    """The engine's scheduler. Guarantees: every admitted request eventually finishes or is aborted;
    cached-token counts and KV events describe exactly what the block pool did."""

    def __init__(self, config: EngineConfig, kv: KvBuffer | None = None) -> None:
        self.config = config
        self.block_size = config.block_size
        self.cache = KvCacheManager(
            config.num_blocks, config.block_size, kv, config.moe_placements, host_blocks=config.host_blocks
        )
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self._by_id: dict[str, EngineRequest] = {}
        # finished prefills whose blocks stay referenced until a KV transfer releases them
        self.held: dict[str, EngineRequest] = {}
        # requests whose prompt KV is on its way from another worker
        self.transferring: dict[str, EngineRequest] = {}
        # cached blocks held for another worker to take, and blocks reserved for ones it gives
        self.offers: dict[str, block_moves.Offer] = {}
        self.intakes: dict[str, block_moves.Intake] = {}
        self.capacity_tokens = config.num_blocks * config.block_size

    @property
    def blocks(self) -> BlockManager:
        """The block pool (for inspection and tests)."""
        return self.cache.blocks

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        spec: EngineRequestSpec,
        *,
        block_hashes: tuple[Sequence[int], Sequence[int]] | None = None,
        hold_on_finish: bool = False,
    ) -> EngineRequest:
        """Queue a request. ``block_hashes`` may carry the prompt's precomputed (local, sequence)
        hashes of its full blocks — the trace replay has them already for routing; they must match
        the prompt. ``hold_on_finish`` keeps its blocks after the last token, until
        :meth:`release_held`."""
        request = self._new_request(spec, block_hashes)
        request.hold_on_finish = hold_on_finish
        self.waiting.append(request)
        self._by_id[spec.request_id] = request
        return request

    def add_remote_prefill(
        self, spec: EngineRequestSpec, *, block_hashes: tuple[Sequence[int], Sequence[int]] | None = None
    ) -> TransferPlan | None:
        """Reserve blocks for a prompt whose KV another worker computed.

        The request waits outside the scheduler until :meth:`finish_transfer`. Returns None,
        leaving nothing behind, when this worker lacks the memory (the caller prefills locally
        instead); see :meth:`KvCacheManager.reserve_transfer`.
        """
        request = self._new_request(spec, block_hashes)
        plan = self.cache.reserve_transfer(request)
        if plan is not None:
            self.transferring[spec.request_id] = request
            self._by_id[spec.request_id] = request
        return plan

    def finish_transfer(self, request_id: str, received: bool) -> None:
        """The transfer of a planned request ended. ``received``: the blocks hold the remote KV, the
        request runs from there (it is admitted at once, even beyond ``max_num_seqs``, since it
        already holds its memory). Otherwise it is queued for an ordinary local prefill."""
        request = self.transferring.pop(request_id, None)
        if request is None:
            return  # aborted meanwhile
        if not received:
            self.cache.free(request)
            self.waiting.append(request)
            return
        self.cache.commit_transfer(request)
        self.running.append(request)

    def held_slots(self, request_id: str, num_blocks: int) -> list[int]:
        """KV slots of the first ``num_blocks`` blocks of a held (finished) prefill."""
        request = self.held.get(request_id)
        if request is None:
            raise EngineRequestError(f"request {request_id!r} holds no KV")
        return [block.slot for block in request.blocks[:num_blocks]]

    def release_held(self, request_id: str) -> bool:
        """Drop a finished prefill's blocks, or an offer's (after its KV transfer, or when nobody
        came for it)."""
        offer = self.offers.pop(request_id, None)
        if offer is not None:
            self.cache.blocks.release(offer.held)
            return True
        request = self.held.pop(request_id, None)
        if request is None:
            return False
        self.cache.free(request)
        return True

    def _new_request(
        self, spec: EngineRequestSpec, block_hashes: tuple[Sequence[int], Sequence[int]] | None
    ) -> EngineRequest:
        request_id, prompt = spec.request_id, spec.prompt
        if request_id in self._by_id or request_id in self.held:
            raise EngineRequestError(f"request {request_id!r} is already in the engine")
        if not prompt:
            raise EngineRequestError("the prompt is empty")
        if spec.max_tokens <= 0:
            raise EngineRequestError("max_tokens must be at least 1")
        too_long = capacity_refusal(len(prompt) + spec.max_tokens, self.block_size, self.config.num_blocks)
        if too_long is not None:
            raise EngineRequestError(too_long)
        if not isinstance(prompt, list | array):
            prompt = list(prompt)
        local, chained = self.cache.prompt_hashes(prompt, spec.lora_name, block_hashes)
        return EngineRequest(
            request_id=request_id,
            prompt=prompt,
            max_tokens=spec.max_tokens,
            stop_token_ids=frozenset(spec.stop_token_ids),
            seed=spec.seed or 0,  # unseeded requests answer alike on every worker
            lora_name=spec.lora_name,
            prompt_key=hash_block_tokens(prompt),
            local_hashes=local,
            seq_hashes=chained,
        )

    def abort(self, request_id: str) -> bool:
        """Remove a request wherever it is and free its blocks; False if it is unknown."""
        request = self._by_id.pop(request_id, None)
        if request is None:
            return self.release_held(request_id)
        # it is in exactly one place: waiting for its KV, running, or waiting to be scheduled
        if self.transferring.pop(request_id, None) is None:
            (self.running if request in self.running else self.waiting).remove(request)
        self.cache.free(request)
        return True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_requests(self) -> int:
        return len(self._by_id)

    def drain_events(self) -> list[EventData]:
        return self.cache.drain_events()

    # a worker that leaves hands its cache on (the replay's shrink: kvmesh.replay.handoff)
    def cached_hashes(self) -> set[int]:
        return self.cache.blocks.cached_hashes()

    def hot_blocks(self, limit: int) -> list[tuple[int, int, int | None]]:
        return self.cache.blocks.recently_used(limit)

    def cached_prefix(self, sequence_hashes: list[int]) -> list[tuple[int, int, int | None]]:
        return self.cache.blocks.cached_prefix(sequence_hashes)

    def adopt_blocks(self, blocks: list[tuple[int, int, int | None]]) -> int:
        return self.cache.blocks.adopt(blocks)

    # ... and a live one does it over the KV transfer (kvmesh.worker.cache_moves)
    def offer_blocks(self, offer_id: str, sequence_hashes: list[int]) -> list[tuple[int, int]]:
        """Hold these cached blocks (those still cached, in order) until :meth:`release_held`
        ``offer_id``; (sequence hash, KV slot) of each held."""
        if offer_id in self.offers or offer_id in self.held:
            raise EngineRequestError(f"{offer_id!r} is already held")
        offer = self.offers[offer_id] = block_moves.hold(self.cache.blocks, sequence_hashes)
        return [(block.sequence_hash, block.slot) for block in offer.held]  # type: ignore[misc]

    def reserve_intake(self, intake_id: str, blocks: list[tuple[int, int, int | None]]) -> list[int]:
        """Fresh blocks for the first of ``blocks`` another worker offers (as many as fit now);
        their slots, to pull the bytes into. End with :meth:`finish_intake`."""
        if intake_id in self.intakes:
            raise EngineRequestError(f"{intake_id!r} is already reserved")
        intake = self.intakes[intake_id] = block_moves.reserve(self.cache.blocks, blocks)
        return intake.slots

    def finish_intake(self, intake_id: str, received: bool) -> int:
        """Cache the reserved blocks whose bytes arrived (``received``) or give them back; how
        many were cached."""
        intake = self.intakes.pop(intake_id, None)
        return block_moves.commit(self.cache.blocks, intake, received) if intake is not None else 0

    def drain_host_events(self) -> list[EventData]:
        """The host tier's events (tier ``host``), apart: they are published as another dp rank."""
        return self.cache.drain_host_events()

    def cached_prefix_tokens(self, prompt: Sequence[int], lora_name: str | None = None) -> int:
        """Prompt tokens this engine's cache would serve right now (for tests and inspection)."""
        return self.cache.cached_prefix_tokens(prompt, lora_name)

    # ---- one iteration -------------------------------------------------------------------
    def step(self) -> StepResult:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[EngineRequest, int]] = []
        cache = self.cache

        # Running sequences first, oldest first; a sequence that cannot get a block preempts the
        # youngest running one (possibly itself).
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            count = self._tokens_this_step(request, budget)
            while not cache.grow(request, request.num_computed + count):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
            else:
                scheduled.append((request, count))
                budget -= count
                index += 1
                continue
            # the request preempted itself; the list shrank under the index

        # Then waiting sequences, FCFS, while there is budget, room and memory.
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not cache.admit(request, budget):
                break
            self.waiting.popleft()
            self.running.append(request)
            count = self._tokens_this_step(request, budget)
            scheduled.append((request, count))
            budget -= count

        return self._execute(scheduled)

    @staticmethod
    def _tokens_this_step(request: EngineRequest, budget: int) -> int:
        # Chunked prefill: a long prompt takes what is left of the step's budget.
        return min(request.num_pending, budget)

    def _preempt(self, request: EngineRequest) -> None:
        self.running.remove(request)
        self.cache.free(request)
        request.num_computed = 0
        request.num_registered = 0
        self.waiting.appendleft(request)

    def _execute(self, scheduled: list[tuple[EngineRequest, int]]) -> StepResult:
        prefill_tokens = 0
        decode_context = 0
        decoding = 0
        for request, count in scheduled:
            if request.num_pending == 1 and request.output:
                decoding += 1
                decode_context += request.num_tokens
            else:
                prefill_tokens += count
        duration = self.config.timing.step_ms(prefill_tokens, decode_context, self.capacity_tokens, decoding > 0)
        reloaded = 0
        for request, _count in scheduled:
            reloaded += request.reloaded_blocks
            request.reloaded_blocks = 0
        if reloaded:  # copies back from host memory: cheaper than computing them, not free
            duration += (
                reloaded * self.block_size * self.config.host_reload_ms_per_token / self.config.timing.speedup_ratio
            )

        outputs: list[TokenOutput] = []
        register = self.cache.register_full_blocks
        for request, count in scheduled:
            request.num_computed += count
            register(request)
            if request.num_pending == 0:
                outputs.append(self._sample(request))
        return StepResult(duration, outputs, prefill_tokens, decoding, decode_context)

    def _sample(self, request: EngineRequest) -> TokenOutput:
        position = len(request.output)
        digest = xxhash.xxh3_64_intdigest(struct.pack("<QQ", request.seed, position), seed=request.prompt_key)
        vocab = self.config.output_vocab
        token = vocab[digest % len(vocab)]
        request.output.append(token)
        finish: FinishReason | None = None
        if token in request.stop_token_ids:
            finish = FinishReason.STOP
        elif len(request.output) >= request.max_tokens:
            finish = FinishReason.LENGTH
        if finish is not None:
            self.running.remove(request)
            self._by_id.pop(request.request_id, None)
            if request.hold_on_finish:
                self.held[request.request_id] = request
            else:
                self.cache.free(request)
        return TokenOutput(request.request_id, token, finish, request.cached_tokens or 0)
