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
hands them over or falls back to a local prefill). With a :class:`KvBuffer`, each computed block's
bytes are written into its slot.

It never sleeps or does I/O: the caller runs steps, waits ``StepResult.duration_ms`` (really or in
virtual time) and then delivers the step's outputs and KV events.
"""

from __future__ import annotations

import struct
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

import xxhash

from kvmesh.common.hashing import hash_block_tokens, local_block_hashes, lora_seed, sequence_hashes
from kvmesh.common.kv_events import EventData
from kvmesh.common.timing import TimingModel
from kvmesh.worker.block_manager import BlockManager, KvBlock
from kvmesh.worker.kv_buffer import KvBuffer

# Printable ASCII byte ids: with the bundled byte-level tokenizer they decode to readable text.
DEFAULT_OUTPUT_VOCAB: tuple[int, ...] = (*range(97, 123), 32, 32, 32, 46)


class FinishReason(Enum):
    LENGTH = "length"
    STOP = "stop"
    CANCELLED = "cancelled"


class EngineRequestError(ValueError):
    """A request the engine can never serve (for instance a prompt larger than the whole cache)."""


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 16384
    block_size: int = 64
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    timing: TimingModel = field(default_factory=TimingModel)
    output_vocab: tuple[int, ...] = DEFAULT_OUTPUT_VOCAB


@dataclass(eq=False)
class EngineRequest:
    """One sequence inside the engine: its tokens, its blocks and how far its KV is computed."""

    request_id: str
    prompt: Sequence[int]
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    seed: int = 0
    lora_name: str | None = None
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    blocks: list[KvBlock] = field(default_factory=list)
    num_registered: int = 0
    cached_tokens: int | None = None  # prompt tokens found in the cache at first admission
    prompt_key: int = 0
    local_hashes: list[int] = field(default_factory=list)
    seq_hashes: list[int] = field(default_factory=list)
    # Keep the blocks referenced after the last token (a prefill whose KV another worker will pull).
    hold_on_finish: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed

    def token_at(self, index: int) -> int:
        n = len(self.prompt)
        return self.prompt[index] if index < n else self.output[index - n]


@dataclass(frozen=True)
class TokenOutput:
    """A token produced for a request in one step; ``finish_reason`` is set on its last one."""

    request_id: str
    token_id: int
    finish_reason: FinishReason | None
    cached_tokens: int


@dataclass(frozen=True)
class TransferPlan:
    """Where a remote prefill's KV lands: blocks ``first_block`` … ``first_block + len(slots) - 1`` of
    the prompt go into these slots; the blocks before ``first_block`` are already cached here."""

    request: EngineRequest
    first_block: int
    slots: list[int]
    sequence_hashes: list[int]

    @property
    def num_blocks(self) -> int:
        return len(self.slots)


def transferable_blocks(prompt_tokens: int, block_size: int) -> int:
    """Full prompt blocks a decode worker takes from a remote prefill. At least one prompt token is
    always left to compute locally, since the step that computes it samples the first output token
    (vLLM's decode side recomputes the last prompt token for the same reason)."""
    return max(0, (prompt_tokens - 1) // block_size)


@dataclass(frozen=True)
class StepResult:
    duration_ms: float
    outputs: list[TokenOutput]
    prefill_tokens: int
    decoding_requests: int


class MockEngine:
    """The engine's scheduler and memory. Guarantees: every admitted request eventually finishes or is
    aborted; cached-token counts and KV events describe exactly what the block pool did."""

    def __init__(self, config: EngineConfig, kv: KvBuffer | None = None) -> None:
        self.config = config
        self.kv = kv
        if kv is not None and kv.num_blocks != config.num_blocks:
            raise ValueError("the KV buffer must have one region per block")
        self.block_size = config.block_size
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self._by_id: dict[str, EngineRequest] = {}
        # finished prefills whose blocks stay referenced until a KV transfer releases them
        self.held: dict[str, EngineRequest] = {}
        # requests whose prompt KV is on its way from another worker
        self.transferring: dict[str, EngineRequest] = {}
        self.capacity_tokens = config.num_blocks * config.block_size

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        stop_token_ids: Sequence[int] = (),
        seed: int = 0,
        lora_name: str | None = None,
        block_hashes: tuple[Sequence[int], Sequence[int]] | None = None,
        hold_on_finish: bool = False,
    ) -> EngineRequest:
        """Queue a request. ``block_hashes`` may carry the prompt's precomputed (local, sequence)
        hashes of its full blocks — the trace replay has them already for routing; they must match
        the prompt. ``hold_on_finish`` keeps its blocks after the last token, until
        :meth:`release_held`."""
        request = self._new_request(request_id, prompt, max_tokens, stop_token_ids, seed, lora_name, block_hashes)
        request.hold_on_finish = hold_on_finish
        self.waiting.append(request)
        self._by_id[request_id] = request
        return request

    def add_remote_prefill(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        stop_token_ids: Sequence[int] = (),
        seed: int = 0,
        lora_name: str | None = None,
        block_hashes: tuple[Sequence[int], Sequence[int]] | None = None,
    ) -> TransferPlan | None:
        """Reserve blocks for a prompt whose KV another worker computed.

        The prompt's cached prefix here is reused; fresh blocks are allocated for the rest of the
        transferable blocks, and the request waits outside the scheduler until
        :meth:`finish_transfer`. Returns None, leaving nothing behind, when this worker lacks the
        memory (the caller prefills locally instead). A plan with no slots means everything
        transferable is cached here already.
        """
        request = self._new_request(request_id, prompt, max_tokens, stop_token_ids, seed, lora_name, block_hashes)
        wanted = transferable_blocks(len(request.prompt), self.block_size)
        hashes = request.seq_hashes[:wanted]
        cached = self.blocks.cached_prefix_length(hashes)
        fresh = wanted - cached
        if fresh + self.blocks.inactive_count(hashes[:cached]) > self.blocks.num_available:
            return None
        request.blocks = self.blocks.acquire_cached(hashes[:cached])
        request.blocks.extend(self.blocks.allocate(fresh))
        request.cached_tokens = cached * self.block_size
        self.transferring[request_id] = request
        self._by_id[request_id] = request
        return TransferPlan(request, cached, [b.slot for b in request.blocks[cached:]], hashes[cached:])

    def finish_transfer(self, request_id: str, received: bool) -> None:
        """The transfer of a planned request ended. ``received``: the blocks hold the remote KV, the
        request runs from there (it is admitted at once, even beyond ``max_num_seqs``, since it
        already holds its memory). Otherwise it is queued for an ordinary local prefill."""
        request = self.transferring.pop(request_id, None)
        if request is None:
            return  # aborted meanwhile
        if not received:
            self._free(request)
            self.waiting.append(request)
            return
        full = len(request.blocks)
        cached = request.cached_tokens // self.block_size if request.cached_tokens else 0
        parent = request.seq_hashes[cached - 1] if cached > 0 else None
        self.blocks.register(
            request.blocks[cached:full], request.seq_hashes[cached:full], request.local_hashes[cached:full], parent
        )
        request.num_computed = full * self.block_size
        request.num_registered = full
        self.running.append(request)

    def release_held(self, request_id: str) -> bool:
        """Drop a finished prefill's blocks (after its KV transfer, or when nobody came for it)."""
        request = self.held.pop(request_id, None)
        if request is None:
            return False
        self._free(request)
        return True

    def _new_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        stop_token_ids: Sequence[int],
        seed: int,
        lora_name: str | None,
        block_hashes: tuple[Sequence[int], Sequence[int]] | None,
    ) -> EngineRequest:
        if request_id in self._by_id or request_id in self.held:
            raise EngineRequestError(f"request {request_id!r} is already in the engine")
        if not prompt:
            raise EngineRequestError("the prompt is empty")
        if max_tokens <= 0:
            raise EngineRequestError("max_tokens must be at least 1")
        needed = -(-(len(prompt) + max_tokens) // self.block_size)
        if needed > self.config.num_blocks:
            raise EngineRequestError(
                f"prompt + max_tokens needs {needed} KV blocks; this worker has {self.config.num_blocks}"
            )
        if not isinstance(prompt, list | array):
            prompt = list(prompt)
        if block_hashes is None:
            local = local_block_hashes(prompt, self.block_size, lora_name)
            chained = sequence_hashes(local)
        else:
            local, chained = list(block_hashes[0]), list(block_hashes[1])
            if not len(local) == len(chained) == len(prompt) // self.block_size:
                raise EngineRequestError("block_hashes does not match the prompt's full blocks")
        request = EngineRequest(
            request_id=request_id,
            prompt=prompt,
            max_tokens=max_tokens,
            stop_token_ids=frozenset(stop_token_ids),
            seed=seed,
            lora_name=lora_name,
            prompt_key=hash_block_tokens(prompt),
            local_hashes=local,
            seq_hashes=chained,
        )
        return request

    def abort(self, request_id: str) -> bool:
        """Remove a request wherever it is and free its blocks; False if it is unknown."""
        request = self._by_id.pop(request_id, None)
        if request is None:
            return self.release_held(request_id)
        # it is in exactly one place: waiting for its KV, running, or waiting to be scheduled
        if self.transferring.pop(request_id, None) is None:
            (self.running if request in self.running else self.waiting).remove(request)
        self._free(request)
        return True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_requests(self) -> int:
        return len(self._by_id)

    def drain_events(self) -> list[EventData]:
        return self.blocks.drain_events()

    def cached_prefix_tokens(self, prompt: Sequence[int], lora_name: str | None = None) -> int:
        """Prompt tokens this engine's cache would serve right now (for tests and inspection)."""
        hashes = sequence_hashes(local_block_hashes(prompt, self.block_size, lora_name))
        return self.blocks.cached_prefix_length(hashes) * self.block_size

    # ---- one iteration -------------------------------------------------------------------
    def step(self) -> StepResult:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[EngineRequest, int]] = []

        # Running sequences first, oldest first; a sequence that cannot get a block preempts the
        # youngest running one (possibly itself).
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            count = self._tokens_this_step(request, budget)
            while not self._grow(request, request.num_computed + count):
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
            if not self._admit(request, budget):
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

    def _grow(self, request: EngineRequest, num_tokens: int) -> bool:
        """Give the request blocks for ``num_tokens`` tokens; False if the pool cannot."""
        needed = -(-num_tokens // self.block_size) - len(request.blocks)
        if needed <= 0:
            return True
        if needed > self.blocks.num_available:
            return False
        request.blocks.extend(self.blocks.allocate(needed))
        return True

    def _admit(self, request: EngineRequest, budget: int) -> bool:
        """Attach the cached prefix and the blocks of the first chunk; False if memory is short."""
        all_hashes = self._full_block_hashes(request)
        cached = self.blocks.cached_prefix_length(all_hashes)
        # At least one token is always computed, so the step has a token to sample from.
        cached = min(cached, (request.num_tokens - 1) // self.block_size)
        prefix = all_hashes[:cached]
        computed = cached * self.block_size
        first_chunk = min(request.num_tokens - computed, budget)
        fresh = -(-(computed + first_chunk) // self.block_size) - cached
        if fresh + self.blocks.inactive_count(prefix) > self.blocks.num_available:
            return False
        request.blocks = self.blocks.acquire_cached(prefix)
        request.blocks.extend(self.blocks.allocate(fresh))
        request.num_computed = computed
        request.num_registered = cached
        if request.cached_tokens is None:
            request.cached_tokens = min(computed, len(request.prompt))
        return True

    def _full_block_hashes(self, request: EngineRequest) -> list[int]:
        """Sequence hashes of every full block of prompt + output so far."""
        full = request.num_tokens // self.block_size
        hashes = request.seq_hashes
        if full > len(hashes):
            seed = lora_seed(request.lora_name)
            for b in range(len(hashes), full):
                start = b * self.block_size
                tokens = [request.token_at(i) for i in range(start, start + self.block_size)]
                local = hash_block_tokens(tokens, seed)
                request.local_hashes.append(local)
                hashes.extend(sequence_hashes([local], hashes[-1] if hashes else None))
        return hashes[:full]

    def _preempt(self, request: EngineRequest) -> None:
        self.running.remove(request)
        self._free(request)
        request.num_computed = 0
        request.num_registered = 0
        self.waiting.appendleft(request)

    def _free(self, request: EngineRequest) -> None:
        self.blocks.release(request.blocks)
        request.blocks = []

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

        outputs: list[TokenOutput] = []
        for request, count in scheduled:
            request.num_computed += count
            self._register_full_blocks(request)
            if request.num_pending == 0:
                outputs.append(self._sample(request))
        return StepResult(duration, outputs, prefill_tokens, decoding)

    def _register_full_blocks(self, request: EngineRequest) -> None:
        full = request.num_computed // self.block_size
        if full <= request.num_registered:
            return
        hashes = self._full_block_hashes(request)
        start = request.num_registered
        parent = hashes[start - 1] if start > 0 else None
        self.blocks.register(request.blocks[start:full], hashes[start:full], request.local_hashes[start:full], parent)
        request.num_registered = full
        if self.kv is not None:
            self.kv.fill_many([block.slot for block in request.blocks[start:full]], hashes[start:full])

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
                self._free(request)
        return TokenOutput(request.request_id, token, finish, request.cached_tokens or 0)
