"""A saturated holder's prefix is pulled, not recomputed and not piled on (docs/decisions/0070).

kv mode holds a prefix on the worker that has it (the duplicate penalty), because a copy evicts
other prefixes and a recomputed copy costs its prefill. When the holder is far busier than the
fleet, holding piles requests on it and lengthens the tail; moving them recomputes long contexts.
A third way: another worker pulls the cached prefix from the holder over the KV transfer the
workers already have (:mod:`kvmesh.worker.cache_moves`), which costs a fraction of its prefill,
and starts the request sooner.

:func:`pull_costs` prices that option beside the others (sans-I/O): only where the holder's cost is
more than ``ratio`` times the other candidates' mean with the pull, so a balanced fleet keeps its
prefixes where they are and pays no copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from kvmesh.common.wire.worker_key import WorkerKey


@dataclass(frozen=True)
class Pull:
    """The chosen worker pulls the prompt's blocks ``first`` to ``first + blocks`` (its own cached
    prefix ends at ``first``) from ``holder`` before it computes the rest."""

    holder: WorkerKey
    first: int
    blocks: int


# each worker's prefill tokens (queued and this request's) -> its predicted cost (ms), in the same order
CostOf = Callable[[list[int]], list[float]]


def pull_costs(
    workers: Sequence[WorkerKey],
    held: Sequence[int],
    counted: Sequence[int],
    costs: Sequence[float],
    prefills: Sequence[int],
    cost_of: CostOf,
    block_size: int,
    ratio: float,
    ms_per_block: float,
    can_pull: Sequence[bool],
) -> tuple[list[float], list[Pull | None]] | None:
    """``costs`` (today's, per worker in ``workers``' order) with the pull priced in, and each
    worker's pull (None: it computes as before); None where no pull is worth pricing.

    ``held``: each worker's cached prefix in blocks, as the index reports it (what a pull can bring);
    ``counted``: the prefix ``prefills`` (each worker's queued prefill plus what it would compute of
    this prompt) were computed with, predictions and prefixes in flight included; ``can_pull``: whether
    each worker's engine moves cached blocks. A worker can pull only from a holder that can; its cost
    with the pull is ``cost_of`` its prefill less the blocks the pull brings, plus the transfer.

    None where: no worker holds a cached prefix; the holder of the longest cannot move blocks; a
    worker is counted to hold more than that prefix (it is still being built, and a pull of the
    shorter one would have the rest computed twice); the holder's prefill tokens not past
    √``ratio`` times the other candidates' mean with the pull (a quick test first: the time a prefill
    takes grows at most with the square of its tokens); or the holder's cost not past ``ratio`` times
    theirs. Guarantees: a cost never rises; a worker that pulls was
    cheaper so than without."""
    best = max(held, default=0)
    if best == 0 or ratio <= 0 or max(counted) > best:
        return None
    holder_index = held.index(best)
    if not can_pull[holder_index]:
        return None
    # the prompt's full blocks are within it, so the blocks a pull brings come off the prefill exactly
    tokens = [p - (best - c) * block_size if ok else p for p, c, ok in zip(prefills, counted, can_pull, strict=True)]
    others = len(tokens) - 1
    if not holder_busy(prefills[holder_index], sum(tokens) - tokens[holder_index], others, ratio):
        return None
    pulled = cost_of(tokens)
    pulled = [c + (best - own) * ms_per_block if ok else c for c, own, ok in zip(pulled, held, can_pull, strict=True)]
    if costs[holder_index] * others <= ratio * (sum(pulled) - pulled[holder_index]):
        return None
    holder = workers[holder_index]
    priced: list[float] = []
    pulls: list[Pull | None] = []
    for cost, with_pull, own, ok in zip(costs, pulled, held, can_pull, strict=True):
        if ok and own < best and with_pull < cost:
            priced.append(with_pull)
            pulls.append(Pull(holder, own, best - own))
        else:
            priced.append(cost)
            pulls.append(None)
    return priced, pulls


def holder_busy(holder_prefill: int, others_tokens: int, others: int, ratio: float) -> bool:
    """:func:`pull_costs`' first test, in tokens, without the cost model (most decisions end here): the
    holder's prefill tokens past √``ratio`` times the ``others`` candidates' mean with the pull
    (``others_tokens`` in all). A prefill's time grows at most with the square of its tokens, so a holder
    not past that is not past ``ratio`` times their cost."""
    return others >= 1 and holder_prefill * others > math.sqrt(ratio) * others_tokens


def no_pull_to_price(
    workers: Sequence[WorkerKey],
    cached: Mapping[WorkerKey, int],
    counted: Sequence[int],
    prefills: Sequence[int],
    block_size: int,
    ratio: float,
    pullable: Collection[WorkerKey],
) -> bool:
    """Whether :func:`pull_costs` would return None at its first tests, told from sums and the sparse
    ``cached`` (what each worker holds, as the index reports it) where every candidate can pull, without
    building its per-worker lists (the routing decision's hot path: at 256 workers those lists cost a
    fifth of the default's decision). False where it cannot tell that way: then price in full.

    Guarantee: True only where :func:`pull_costs` on the same figures returns None."""
    if not isinstance(pullable, (set, frozenset)) or not pullable.issuperset(workers):
        return False
    best = max(cached.values(), default=0)
    if best == 0:
        return True
    positions = []
    for worker, blocks in cached.items():
        if blocks == best and worker in pullable:  # a candidate (all of them can pull), or none
            try:
                positions.append(workers.index(worker))
            except ValueError:  # can pull but is no candidate here
                continue
    if not positions:  # the longest prefix is held off the candidates: theirs is shorter
        return False
    if ratio <= 0 or max(counted) > best:
        return True
    holder = min(positions)  # pull_costs' holder: the first candidate holding the longest
    # pull_costs' tokens (each worker's prefill less the blocks a pull brings), summed without the list
    pulled_holder = prefills[holder] - (best - counted[holder]) * block_size
    others_tokens = sum(prefills) - block_size * (best * len(workers) - sum(counted)) - pulled_holder
    return not holder_busy(prefills[holder], others_tokens, len(workers) - 1, ratio)
