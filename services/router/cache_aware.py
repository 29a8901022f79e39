"""SGLang's ``cache_aware`` routing policy (as sglang-router 0.3.2 defines it) on kvmesh's tokens.

The router remembers what it sent where in one multi-tenant radix tree (a tenant is a worker) and
never hears from the workers' caches: no KV events. Per request, :class:`CacheAwareSelector`:

1. if the loads are imbalanced, ``max - min > balance_abs_threshold`` *and*
   ``max > min × balance_rel_threshold`` (load: requests in flight), takes the least-loaded worker;
2. otherwise matches the prompt against the tree: when the matched fraction is above
   ``cache_threshold`` it takes the worker that holds the match, else (a miss) the worker with the
   smallest tree (the most cache to spare), or with ``miss_policy="least-loaded"`` the worker with
   the fewest requests in flight, which is what sglang-router 0.3.2's code does (decision 0016);
3. inserts the prompt under the chosen worker (in both cases), stamped with the time;
4. every ``eviction_interval_secs`` trims each worker's share of the tree to ``max_tree_size``
   tokens, least recently used leaves first.

Where kvmesh differs, and why (decision 0016): SGLang's tree holds characters of the request text so
that it need not tokenise; kvmesh's router already has the token ids, so the tree holds those and
sizes are in tokens. Among several workers that hold the deepest match, SGLang takes whichever its
hash map lists first; kvmesh takes the most recently used one, and breaks ties between equally
small trees with the router's seeded random generator, so a replay is deterministic. Eviction runs
when a request arrives after the interval has passed rather than on a timer thread, which is the
same schedule in virtual time (replay) and live.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvmesh.common.wire.worker_key import WorkerKey

TOKEN_BYTES = 4  # the tree's byte strings hold token ids as little-endian uint32 (hashing.token_bytes)


def common_prefix_bytes(a: bytes | memoryview, b: bytes | memoryview) -> int:
    """Length in bytes of the longest whole-token common prefix of ``a`` and ``b``.

    A binary search over memoryview slices (each comparison a memcmp, no copying): a Python loop
    over tokens would cost more than the rest of the routing decision for long prompts."""
    a, b = memoryview(a), memoryview(b)
    n = min(len(a), len(b)) // TOKEN_BYTES
    if a[: n * TOKEN_BYTES] == b[: n * TOKEN_BYTES]:
        return n * TOKEN_BYTES
    low, high = 0, n  # the first `low` tokens agree; the first `high` do not
    while high - low > 1:
        middle = (low + high) // 2
        if a[: middle * TOKEN_BYTES] == b[: middle * TOKEN_BYTES]:
            low = middle
        else:
            high = middle
    return low * TOKEN_BYTES


@dataclass(eq=False)
class _Node:
    tokens: bytes
    parent: _Node | None
    children: dict[bytes, _Node] = field(default_factory=dict)  # keyed by the child's first token
    last_access: dict[WorkerKey, float] = field(default_factory=dict)  # the tenants that hold this node


class TenantTree:
    """A multi-tenant radix tree over token ids.

    Guarantees: a tenant is listed on a node only if a prompt inserted for it ran through that
    node's whole path (so it is listed on every ancestor too); :meth:`size` of a tenant is the total
    token count of the nodes that list it; a node no tenant lists is removed.
    """

    def __init__(self) -> None:
        self._root = _Node(b"", None)
        self._sizes: dict[WorkerKey, int] = {}

    def size(self, tenant: WorkerKey) -> int:
        return self._sizes.get(tenant, 0)

    def sizes(self) -> dict[WorkerKey, int]:
        return dict(self._sizes)

    def insert(self, tokens: bytes, tenant: WorkerKey, now: float) -> None:
        """Record that ``tenant`` was sent a prompt of these tokens at ``now``."""
        node = self._root
        node.last_access[tenant] = now
        self._sizes.setdefault(tenant, 0)
        at = 0
        while at < len(tokens):
            child = node.children.get(tokens[at : at + TOKEN_BYTES])
            if child is None:
                child = _Node(tokens[at:], node)
                node.children[child.tokens[:TOKEN_BYTES]] = child
                self._claim(child, tenant, now)
                return
            shared = common_prefix_bytes(child.tokens, memoryview(tokens)[at:])
            if shared < len(child.tokens):
                child = self._split(child, shared)
            self._claim(child, tenant, now)
            node = child
            at += shared

    def match(self, tokens: bytes, tenants: set[WorkerKey]) -> tuple[int, WorkerKey | None]:
        """(matched tokens, tenant): the longest prefix of ``tokens`` that one of ``tenants`` holds,
        and the most recently used of those that hold all of it (None when nothing matches)."""
        matched, holders = self.holders(tokens, tenants)
        return matched, holders[0] if holders else None

    def holders(self, tokens: bytes, tenants: set[WorkerKey]) -> tuple[int, list[WorkerKey]]:
        """(matched tokens, every one of ``tenants`` that holds that whole match, most recent first)."""
        node = self._root
        at = 0
        while at < len(tokens):
            child = node.children.get(tokens[at : at + TOKEN_BYTES])
            if child is None or tenants.isdisjoint(child.last_access):
                break
            shared = common_prefix_bytes(child.tokens, memoryview(tokens)[at:])
            node = child
            at += shared
            if shared < len(child.tokens):
                break
        if node is self._root:
            return 0, []
        held = sorted((-stamp, tenant) for tenant, stamp in node.last_access.items() if tenant in tenants)
        return at // TOKEN_BYTES, [tenant for _, tenant in held]  # latest first; then the smallest key

    def evict(self, max_size: int) -> int:
        """Trim every tenant to at most ``max_size`` tokens, its least recently used leaves first;
        returns the tokens evicted."""
        over = {tenant for tenant, size in self._sizes.items() if size > max_size}
        if not over:
            return 0
        heap: list[tuple[float, int, WorkerKey, _Node]] = []
        order = 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for tenant in over.intersection(node.last_access):
                if node is not self._root and self._is_leaf_of(node, tenant):
                    heap.append((node.last_access[tenant], order, tenant, node))
                    order += 1
        heapq.heapify(heap)
        evicted = 0
        while heap:
            _, _, tenant, node = heapq.heappop(heap)
            if self._sizes[tenant] <= max_size or tenant not in node.last_access:
                continue
            evicted += self._release(node, tenant)
            parent = node.parent
            if parent is not None and parent is not self._root and self._is_leaf_of(parent, tenant):
                heapq.heappush(heap, (parent.last_access[tenant], order, tenant, parent))
                order += 1
        return evicted

    def remove_tenant(self, tenant: WorkerKey) -> None:
        """Forget everything ``tenant`` was sent (a worker that left)."""
        stack = [self._root]
        doomed = []
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if tenant in node.last_access and node is not self._root:
                doomed.append(node)
        for node in reversed(doomed):  # children before parents: a parent empties last
            self._release(node, tenant)
        self._root.last_access.pop(tenant, None)
        self._sizes.pop(tenant, None)

    def _claim(self, node: _Node, tenant: WorkerKey, now: float) -> None:
        if tenant not in node.last_access:
            self._sizes[tenant] += len(node.tokens) // TOKEN_BYTES
        node.last_access[tenant] = now

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node`` after ``at`` bytes; returns the new upper part (same tenants, same stamps)."""
        assert node.parent is not None
        head = _Node(node.tokens[:at], node.parent, last_access=dict(node.last_access))
        node.parent.children[head.tokens[:TOKEN_BYTES]] = head
        node.tokens = node.tokens[at:]
        node.parent = head
        head.children[node.tokens[:TOKEN_BYTES]] = node
        return head

    def _release(self, node: _Node, tenant: WorkerKey) -> int:
        del node.last_access[tenant]
        tokens = len(node.tokens) // TOKEN_BYTES
        self._sizes[tenant] -= tokens
        if not node.last_access and node.parent is not None:
            node.parent.children.pop(node.tokens[:TOKEN_BYTES], None)
        return tokens

    @staticmethod
    def _is_leaf_of(node: _Node, tenant: WorkerKey) -> bool:
        return all(tenant not in child.last_access for child in node.children.values())


@dataclass(frozen=True)
class CacheAwareOptions:
    """sglang-router 0.3.2's defaults (``router_args.py``)."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_secs: float = 60.0
    max_tree_size: int = 2**26
    # On a miss: "smallest-tree" (SGLang's documented policy) or "least-loaded" (its 0.3.2 code).
    miss_policy: str = "smallest-tree"

    def imbalanced(self, high: int, low: int) -> bool:
        """Whether loads of ``high`` and ``low`` requests in flight (the most and the fewest among the
        candidates) are imbalanced: apart by more than ``balance_abs_threshold`` and by more than
        ``balance_rel_threshold`` times."""
        return high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold

    def hit(self, matched: int, total: int) -> bool:
        """Whether a prompt of ``total`` tokens, ``matched`` of them held by one worker, is a cache
        hit: more than ``cache_threshold`` of it matched (an empty prompt never is)."""
        return total > 0 and matched / total > self.cache_threshold


MISS_POLICIES = ("smallest-tree", "least-loaded")


@dataclass(frozen=True)
class CacheAwareChoice:
    worker: WorkerKey
    matched_tokens: int  # of the prompt, on the chosen worker as far as the tree knows
    reason: str  # "imbalanced", "cache_hit", "smallest_tree" or "least_loaded"


class CacheAwareSelector:
    """Chooses workers as the module docstring describes. Sans-I/O: the caller passes the time."""

    def __init__(self, options: CacheAwareOptions | None = None, rng: random.Random | None = None) -> None:
        self.options = options or CacheAwareOptions()
        self.tree = TenantTree()
        self._rng = rng or random.Random()
        self._last_eviction: float | None = None

    def select(
        self,
        workers: Sequence[WorkerKey],
        tokens: bytes,
        requests_in_flight: Mapping[WorkerKey, int],
        now: float,
        commit: bool = True,
    ) -> CacheAwareChoice:
        """The worker for a prompt of ``tokens``; ``commit=False`` leaves the tree untouched (a query)."""
        if not workers:
            raise ValueError("no candidate workers")
        self._evict_if_due(now)
        options = self.options
        ordered = sorted(workers)
        loads = [requests_in_flight.get(worker, 0) for worker in ordered]
        low = min(loads)
        if options.imbalanced(max(loads), low):
            worker = ordered[loads.index(low)]
            choice = CacheAwareChoice(worker, self.tree.match(tokens, {worker})[0], "imbalanced")
        else:
            matched, holder = self.tree.match(tokens, set(ordered))
            total = len(tokens) // TOKEN_BYTES
            if holder is not None and options.hit(matched, total):
                choice = CacheAwareChoice(holder, matched, "cache_hit")
            else:
                tied, reason = self.miss_candidates(ordered, loads)
                worker = tied[0] if len(tied) == 1 else self._rng.choice(tied)
                choice = CacheAwareChoice(worker, matched if worker == holder else 0, reason)
        if commit:
            self.tree.insert(tokens, choice.worker, now)
        return choice

    def miss_candidates(self, ordered: Sequence[WorkerKey], loads: Sequence[int]) -> tuple[list[WorkerKey], str]:
        """The workers a miss may go to (ties among them are broken at random), and the reason."""
        if self.options.miss_policy == "least-loaded":
            least = min(loads)
            return [worker for worker, load in zip(ordered, loads, strict=True) if load == least], "least_loaded"
        sizes = [self.tree.size(worker) for worker in ordered]
        smallest = min(sizes)
        return [worker for worker, size in zip(ordered, sizes, strict=True) if size == smallest], "smallest_tree"

    def forget(self, worker: WorkerKey) -> None:
        self.tree.remove_tenant(worker)

    def _evict_if_due(self, now: float) -> None:
        if self._last_eviction is None:
            self._last_eviction = now
        elif now - self._last_eviction >= self.options.eviction_interval_secs:
            self._last_eviction = now
            self.tree.evict(self.options.max_tree_size)
