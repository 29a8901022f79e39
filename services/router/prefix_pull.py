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

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from kvmesh.common.wire.worker_key import WorkerKey


@dataclass(frozen=True)
class Pull:
    """The chosen worker pulls the prompt's blocks ``first`` to ``first + blocks`` (its own cached
    prefix ends at ``first``) from ``holder`` before it computes the rest."""

    holder: WorkerKey
    first: int
    blocks: int


# (workers, each worker's overlap to cost with) -> each worker's predicted cost (ms), workers' order
CostWith = Callable[[Sequence[WorkerKey], dict[WorkerKey, int]], list[float]]


def pull_costs(
    workers: Sequence[WorkerKey],
    held: Sequence[int],
    costs: Sequence[float],
    cost_with: CostWith,
    ratio: float,
    ms_per_block: float,
    pullable: Collection[WorkerKey],
    counted: Sequence[int] | None = None,
) -> tuple[list[float], list[Pull | None]] | None:
    """``costs`` (today's, per worker in ``workers``' order) with the pull priced in, and each
    worker's pull (None: it computes as before); None where no pull is worth pricing: no pullable
    holder, or the holder not past ``ratio`` times the other candidates' mean with the pull, or a worker
    counted (``counted``: the overlaps ``costs`` were computed with, predictions and prefixes in flight
    included) to hold more than the longest cached prefix: that one is still being built, and a pull
    of the shorter one would have the rest computed twice.

    ``held``: each worker's cached prefix in blocks, as the index reports it (what a pull can bring).
    A worker can pull only from a ``pullable`` holder and only if it is ``pullable`` itself; its cost
    with the pull is its cost computing the prompt past the holder's prefix, plus the transfer.
    Guarantees: a cost never rises; a worker that pulls was cheaper so than without."""
    best = max(held, default=0)
    if best == 0 or ratio <= 0 or (counted is not None and max(counted, default=0) > best):
        return None
    holder_index = held.index(best)
    holder = workers[holder_index]
    if holder not in pullable:
        return None
    overlaps = {w: best if w in pullable else own for w, own in zip(workers, held, strict=True)}
    pulled = cost_with(workers, overlaps)
    pulled = [
        c + (best - own) * ms_per_block if w in pullable else c for w, c, own in zip(workers, pulled, held, strict=True)
    ]
    others = [cost for i, cost in enumerate(pulled) if i != holder_index]
    if not others or costs[holder_index] <= ratio * sum(others) / len(others):
        return None
    priced: list[float] = []
    pulls: list[Pull | None] = []
    for worker, cost, with_pull, own in zip(workers, costs, pulled, held, strict=True):
        if own < best and worker in pullable and with_pull < cost:
            priced.append(with_pull)
            pulls.append(Pull(holder, own, best - own))
        else:
            priced.append(cost)
            pulls.append(None)
    return priced, pulls
