"""Prefill/decode disaggregation in the router: whether a request prefills remotely, where, and the
prefill request that runs beside (bootstrap) or before (sync) its decode.

Active only while a prefill-role worker for the request's model is registered. Per request:

1. the decode worker is chosen KV-aware as for an aggregated request; if it lacks fewer than
   ``--disagg-min-uncached-tokens`` of the prompt, it prefills locally (a transfer would cost more
   than it saves);
2. otherwise a prefill worker with capacity is chosen KV-aware among the prefill pool (none with
   capacity: local prefill), and the decode worker is chosen again on load alone (overlap weight 0),
   since its cache no longer decides how much prefill it does;
3. given the measured overhead of a split (``split_overhead_ms``, :mod:`~kvmesh.router.split_overhead`)
   and the ``ttft`` cost model, the request prefills remotely only if the prefill worker's predicted
   time to its first token plus that overhead is below what a local prefill costs: the decode
   worker's own prediction of the request's first token, plus the stall the prefill's steps put on
   every request decoding there (each waits that long for its next token; docs/decisions/0039).
   Else local, reason ``no_gain``.

With ``--prefill-policy`` / ``--decode-policy`` (SGLang's PD pairing) each pool is chosen in its
own mode. Step 1 needs the decode worker's cached overlap, which only a ``kv`` decode policy knows;
with any other decode policy every request prefills remotely while a prefill worker has capacity.

``--enforce-disagg`` turns every fallback into an error. See docs/decisions/0009.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvmesh.common.wire.worker_key import WorkerKey
from kvmesh.router.policy import RoutingPolicy
from kvmesh.router.scheduler import Candidate
from kvmesh.router.split_overhead import split_pays


@dataclass(frozen=True)
class Placement:
    """Where one request prefills and decodes (sans-I/O; worker keys, not records).

    ``prefill`` is None for a local prefill on ``decode``, with the ``reason``; ``overlap`` is the
    cached prefix in blocks on the worker that prefills."""

    decode: WorkerKey
    prefill: WorkerKey | None
    overlap: int
    reason: str = ""
    # a remote prefill's predicted milliseconds to its first token on the prefill worker (None: not
    # predicted), from which the router measures what the split added
    predicted_prefill_ms: float | None = None


class NoCapacity(Exception):
    """Every prefill worker is at capacity (only raised when local prefill is not allowed)."""


def place_prefill(
    policy: RoutingPolicy,
    decode_workers: Sequence[WorkerKey],
    prefill_workers: Sequence[WorkerKey],
    block_hashes: Sequence[int],
    prompt_tokens: int,
    overlaps: Mapping[WorkerKey, int],
    tree_sizes: Mapping[WorkerKey, int],
    *,
    min_uncached_tokens: int,
    prefill_queue_limit_tokens: int,
    enforce: bool = False,
    overlap_score_weight: float | None = None,
    temperature: float | None = None,
    expected_output_tokens: int = 0,
    busy: Callable[[WorkerKey], bool] = lambda _key: False,
    prefill_policy: RoutingPolicy | None = None,
    tokens: bytes | None = None,
    now: float = 0.0,
    moe_hosted: Mapping[WorkerKey, float] | None = None,
    split_overhead_ms: float | None = None,
    duplicate_penalty: float | None = None,
) -> Placement:
    """The per-request decision of the module docstring. ``policy`` chooses decode workers and, unless
    ``prefill_policy`` is given, prefill workers too; ``tokens`` and ``now`` are for cache-aware mode.
    ``duplicate_penalty``: this request's, where it is not each policy's own.
    The router service and ``kvmesh replay`` both call it, so the replay measures what the service does."""
    prefill_policy = prefill_policy or policy
    args = (block_hashes, prompt_tokens, overlaps, tree_sizes)
    context = {"tokens": tokens, "now": now, "moe_hosted": moe_hosted, "duplicate_penalty": duplicate_penalty}
    local = None
    if policy.needs_overlaps:
        local = policy.choose(
            decode_workers,
            *args,
            overlap_score_weight,
            temperature,
            expected_output_tokens,
            moe_hosted=moe_hosted,
            duplicate_penalty=duplicate_penalty,
        )
        uncached = prompt_tokens - local.overlap_blocks * policy.block_size
        if not enforce and uncached < min_uncached_tokens:
            return Placement(local.worker, None, local.overlap_blocks, "below_threshold")
    with_capacity = [
        key for key in prefill_workers if not busy(key) and policy.active.load(key)[0] < prefill_queue_limit_tokens
    ]
    if not with_capacity:
        if enforce:
            raise NoCapacity(f"all {len(prefill_workers)} prefill workers are at capacity")
        if local is None:
            local = policy.choose(
                decode_workers, *args, overlap_score_weight, temperature, expected_output_tokens, **context
            )
        return Placement(local.worker, None, local.overlap_blocks, "no_prefill_capacity")
    prefill = prefill_policy.choose(with_capacity, *args, overlap_score_weight, temperature, 0, **context)
    prefill_overlap = overlaps.get(prefill.worker, prefill.overlap_blocks)
    remote_ms = predicted_ttft_ms(prefill_policy, prefill.worker, prompt_tokens - prefill_overlap * policy.block_size)
    if split_overhead_ms is not None and local is not None and not enforce and remote_ms is not None:
        uncached = prompt_tokens - local.overlap_blocks * policy.block_size
        local_ms = predicted_ttft_ms(policy, local.worker, uncached)
        if local_ms is not None:
            local_ms += decode_stall_ms(policy, local.worker, uncached)
            if not split_pays(local_ms, remote_ms, split_overhead_ms):
                return Placement(local.worker, None, local.overlap_blocks, "no_gain")
    decode = policy.choose(decode_workers, *args, 0.0, temperature, expected_output_tokens, **context)
    return Placement(decode.worker, prefill.worker, prefill_overlap, predicted_prefill_ms=remote_ms)


def predicted_ttft_ms(policy: RoutingPolicy, worker: WorkerKey, uncached_tokens: int) -> float | None:
    """The ``ttft`` cost model's milliseconds to the first token of a request that prefills
    ``uncached_tokens`` on ``worker`` now (its queued prefill first); None with another cost model."""
    model = policy.cost_model
    if model.name != "ttft":
        return None
    prefill_tokens, decode_blocks = policy.active.load(worker)
    return model.cost(Candidate(worker, prefill_tokens + max(0, uncached_tokens), decode_blocks), 1.0)


def decode_stall_ms(policy: RoutingPolicy, worker: WorkerKey, uncached_tokens: int) -> float:
    """What prefilling ``uncached_tokens`` on ``worker`` costs the requests decoding there, in
    request-milliseconds: each step that carries a chunk of it delays every one of them by that
    chunk's prefill time (the ``ttft`` model's prefill time of the tokens alone). 0 with another
    cost model, or with nothing decoding there."""
    decoding = policy.active.decoding(worker)
    if policy.cost_model.name != "ttft" or not decoding or uncached_tokens <= 0:
        return 0.0
    return decoding * policy.cost_model.cost(Candidate(worker, uncached_tokens, 0), 1.0)
