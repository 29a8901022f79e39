"""Which workers may take a request, with one typed reason per exclusion (sans-I/O, clock passed in).

The router asks two questions before it costs anyone: does the worker serve this model (and the
LoRA adapter the request names) in this role, and has its stream broken recently. Whether a worker is
over the busy thresholds decides admission, not eligibility: while every worker is, the request
waits (:meth:`~kvmesh.router.load_picture.LoadPicture.admitted`, docs/decisions/0045); and a prefill
worker over them has no capacity for another prefill. Each is a pure step here, so the rules read
on one page and are tested without a network.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, Protocol, TypeVar

from kvmesh.common.wire.lora import served_adapters


class Exclusion(Enum):
    """Why a worker was left out of a request's candidates."""

    OTHER_MODEL = "other_model"
    NO_ADAPTER = "no_adapter"  # it does not serve the LoRA adapter the request names
    # prefill-role workers only ever prefill for another worker; decode-role workers can prefill
    # locally and so serve whole requests
    PREFILL_ROLE = "prefill_role"
    NOT_PREFILL_ROLE = "not_prefill_role"
    OTHER_BLOCK_SIZE = "other_block_size"
    RECENTLY_FAILED = "recently_failed"
    BUSY = "busy"


class WorkerLike(Protocol):
    """What the filters read of a discovered worker (``InstanceRecord`` has it)."""

    @property
    def instance_id(self) -> int: ...
    @property
    def model(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def extra(self) -> Mapping[str, Any]: ...


W = TypeVar("W", bound=WorkerLike)


@dataclass
class Eligibility(Generic[W]):
    """The workers that passed, and the reason each other one did not."""

    eligible: list[W]
    excluded: dict[int, Exclusion] = field(default_factory=dict)


class FailedWorkers:
    """Workers whose stream broke lately; each stays excluded for ``avoid_secs`` after its failure."""

    def __init__(self, avoid_secs: float) -> None:
        self.avoid_secs = avoid_secs
        self._until: dict[int, float] = {}

    def mark(self, worker_id: int, now: float) -> None:
        self._until[worker_id] = now + self.avoid_secs

    def avoiding(self, now: float) -> set[int]:
        """The workers still avoided at ``now``: one pass over the few marked, where asking about each
        candidate in turn cost a routing decision at 256 workers about 40 µs."""
        return {worker_id for worker_id, until in self._until.items() if until > now}

    def forget(self, worker_id: int) -> None:
        self._until.pop(worker_id, None)


@dataclass(frozen=True)
class BusyThresholds:
    """``--active-decode-blocks-threshold`` and ``--active-prefill-tokens-threshold`` (None: no limit)."""

    active_decode_blocks: int | None = None
    active_prefill_tokens: int | None = None

    def exceeded(self, prefill_tokens: int, decode_blocks: int) -> bool:
        return (self.active_decode_blocks is not None and decode_blocks > self.active_decode_blocks) or (
            self.active_prefill_tokens is not None and prefill_tokens > self.active_prefill_tokens
        )


def whole_request_workers(
    workers: Sequence[W], model: str, failed: FailedWorkers, now: float, lora: str | None = None
) -> Eligibility[W]:
    """Workers that serve ``model`` (and the adapter ``lora``, when one is named) whole requests.
    Recently failed ones are left out unless no other is left (a failed worker is a better answer
    than none)."""
    result: Eligibility[W] = Eligibility([])
    for worker in workers:
        if model and worker.model != model:
            result.excluded[worker.instance_id] = Exclusion.OTHER_MODEL
        elif lora and lora not in served_adapters(worker.extra):
            result.excluded[worker.instance_id] = Exclusion.NO_ADAPTER
        elif worker.role == "prefill":
            result.excluded[worker.instance_id] = Exclusion.PREFILL_ROLE
        else:
            result.eligible.append(worker)
    return _without_failed(result, failed, now, keep_if_none_left=True)


def prefill_workers(
    workers: Sequence[W], model: str, block_size: int, failed: FailedWorkers, now: float, lora: str | None = None
) -> Eligibility[W]:
    """Prefill-role workers for ``model`` (and the adapter ``lora``, when one is named) whose KV
    blocks match the decode side's ``block_size`` (blocks must line up to be transferred), without
    recently failed ones."""
    result: Eligibility[W] = Eligibility([])
    for worker in workers:
        if worker.role != "prefill":
            result.excluded[worker.instance_id] = Exclusion.NOT_PREFILL_ROLE
        elif model and worker.model != model:
            result.excluded[worker.instance_id] = Exclusion.OTHER_MODEL
        elif lora and lora not in served_adapters(worker.extra):
            result.excluded[worker.instance_id] = Exclusion.NO_ADAPTER
        elif worker.block_size != block_size:
            result.excluded[worker.instance_id] = Exclusion.OTHER_BLOCK_SIZE
        else:
            result.eligible.append(worker)
    return _without_failed(result, failed, now, keep_if_none_left=False)


def not_busy(
    workers: Sequence[W], load: Callable[[int], tuple[int, int]], thresholds: BusyThresholds
) -> Eligibility[W]:
    """Workers under the busy thresholds; ``load(worker_id)`` is its (prefill tokens, decode blocks)."""
    result: Eligibility[W] = Eligibility([])
    for worker in workers:
        if thresholds.exceeded(*load(worker.instance_id)):
            result.excluded[worker.instance_id] = Exclusion.BUSY
        else:
            result.eligible.append(worker)
    return result


def _without_failed(
    result: Eligibility[W], failed: FailedWorkers, now: float, keep_if_none_left: bool
) -> Eligibility[W]:
    avoiding = failed.avoiding(now)
    if not avoiding:
        return result
    healthy = [w for w in result.eligible if w.instance_id not in avoiding]
    if not healthy and keep_if_none_left:
        return result
    for worker in result.eligible:
        if worker.instance_id in avoiding:
            result.excluded[worker.instance_id] = Exclusion.RECENTLY_FAILED
    return Eligibility(healthy, result.excluded)
