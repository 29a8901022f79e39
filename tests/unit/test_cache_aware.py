"""SGLang's cache-aware policy on token ids: the tenant tree and the selector's three branches."""

from __future__ import annotations

import random

import pytest

from kvmesh.common.wire.hashing import token_bytes
from kvmesh.router.cache_aware import (
    CacheAwareOptions,
    CacheAwareSelector,
    TenantTree,
    common_prefix_bytes,
)
from kvmesh.router.config import RouterConfig
from tests.support import service_config

A, B, C = (1, 0), (2, 0), (3, 0)


def tokens(*runs: range) -> bytes:
    return token_bytes([t for run in runs for t in run])


def test_common_prefix_counts_whole_tokens_only():
    assert common_prefix_bytes(token_bytes([1, 2, 3]), token_bytes([1, 2, 4])) == 8
    assert common_prefix_bytes(token_bytes([1, 2]), token_bytes([1, 2, 9, 9])) == 8
    assert common_prefix_bytes(token_bytes([256]), token_bytes([257])) == 0  # first byte differs only
    assert common_prefix_bytes(b"", token_bytes([1])) == 0


def test_a_match_names_the_tenant_that_holds_the_longest_prefix():
    tree = TenantTree()
    tree.insert(tokens(range(100)), A, now=1)
    tree.insert(tokens(range(50), range(1000, 1030)), B, now=2)  # splits A's node at 50
    assert tree.match(tokens(range(80)), {A, B}) == (80, A)
    assert tree.match(tokens(range(50), range(1000, 1010)), {A, B}) == (60, B)
    assert tree.match(tokens(range(40)), {A, B}) == (40, B)  # both hold it: the most recent
    assert tree.match(tokens(range(40)), {A}) == (40, A)
    assert tree.match(tokens(range(80)), {B}) == (50, B)  # only as far as B holds it
    assert tree.match(tokens(range(500, 510)), {A, B}) == (0, None)
    assert tree.sizes() == {A: 100, B: 80}


def test_eviction_trims_each_tenant_from_its_least_recently_used_leaves():
    tree = TenantTree()
    tree.insert(tokens(range(10), range(100, 120)), A, now=1)  # oldest leaf: 100..119
    tree.insert(tokens(range(10), range(200, 220)), A, now=2)
    tree.insert(tokens(range(10), range(300, 305)), B, now=3)
    assert tree.sizes() == {A: 50, B: 15}
    assert tree.evict(max_size=30) == 20
    assert tree.sizes() == {A: 30, B: 15}
    assert tree.match(tokens(range(10), range(100, 120)), {A}) == (10, A)
    assert tree.match(tokens(range(10), range(200, 220)), {A}) == (30, A)
    # whole nodes go: A's last leaf (20), then the shared edge for A (10); B's leaf (5), then its share (10)
    assert tree.evict(max_size=5) == 20 + 10 + 5 + 10
    assert tree.sizes() == {A: 0, B: 0}
    assert tree.match(tokens(range(10)), {A, B}) == (0, None)


def test_a_removed_tenant_leaves_no_trace_and_others_keep_theirs():
    tree = TenantTree()
    tree.insert(tokens(range(20)), A, now=1)
    tree.insert(tokens(range(10), range(50, 60)), B, now=2)
    tree.remove_tenant(A)
    assert tree.sizes() == {B: 20}
    assert tree.match(tokens(range(20)), {A, B}) == (10, B)
    tree.insert(tokens(range(20)), A, now=3)  # a new tenant with that key starts clean
    assert tree.sizes() == {A: 20, B: 20}


def selector(**options) -> CacheAwareSelector:
    return CacheAwareSelector(CacheAwareOptions(**options), random.Random(0))


def test_a_good_match_goes_to_its_holder_and_a_poor_one_to_the_smallest_tree():
    select = selector(cache_threshold=0.5)
    first = select.select([A, B, C], tokens(range(100)), {}, now=0)
    assert first.reason == "smallest_tree"
    again = select.select([A, B, C], tokens(range(90), range(900, 910)), {}, now=1)
    assert (again.worker, again.matched_tokens, again.reason) == (first.worker, 90, "cache_hit")
    poor = select.select([A, B, C], tokens(range(40), range(700, 760)), {}, now=2)  # 40% matched
    assert poor.reason == "smallest_tree" and poor.worker != first.worker
    assert select.tree.size(poor.worker) == 100


def test_the_least_loaded_miss_rule_sends_a_miss_to_the_fewest_requests_in_flight_not_the_smallest_tree():
    select = selector(cache_threshold=0.5, miss_policy="least-loaded")
    held = select.select([A, B, C], tokens(range(100)), {}, now=0).worker
    others = [w for w in (A, B, C) if w != held]
    # balanced loads (1 - 0 is within the thresholds), a miss: the smallest trees are the two others,
    # but only the held worker is idle
    loads = {held: 0, others[0]: 1, others[1]: 1}
    miss = select.select([A, B, C], tokens(range(500, 600)), loads, now=1)
    assert (miss.worker, miss.reason) == (held, "least_loaded")
    assert select.tree.size(held) == 200
    hit = select.select([A, B, C], tokens(range(500, 590), range(900, 910)), loads, now=2)
    assert (hit.worker, hit.reason) == (held, "cache_hit")  # a hit still goes to the holder
    with pytest.raises(SystemExit):
        service_config(RouterConfig, ["--cache-miss-policy", "largest-tree"])


def test_imbalanced_loads_take_the_least_loaded_worker_and_still_record_it():
    select = selector(balance_abs_threshold=4, balance_rel_threshold=1.5)
    held = select.select([A, B], tokens(range(100)), {}, now=0).worker
    other = B if held == A else A
    busy = {held: 10, other: 5}  # 10 - 5 > 4 and 10 > 5 × 1.5
    choice = select.select([A, B], tokens(range(100)), busy, now=1)
    assert (choice.worker, choice.reason) == (other, "imbalanced")
    assert select.tree.size(other) == 100
    balanced = {held: 10, other: 7}  # 10 > 7 × 1.5 fails: balanced, the cache decides
    assert select.select([A, B], tokens(range(100)), balanced, now=2).reason == "cache_hit"


def test_a_query_leaves_the_tree_untouched():
    select = selector()
    select.select([A, B], tokens(range(100)), {}, now=0, commit=False)
    assert select.tree.sizes() == {}


def test_eviction_runs_once_per_interval_of_request_time():
    select = selector(eviction_interval_secs=10, max_tree_size=50)
    for now, start in ((0, 0), (3, 1000), (6, 2000)):
        select.select([A], tokens(range(start, start + 30)), {}, now=now)
    assert select.tree.size(A) == 90  # no eviction within the interval
    select.select([A], tokens(range(3000, 3010)), {}, now=10)  # evicts first (the two oldest), then inserts
    assert select.tree.size(A) == 30 + 10
    assert select.tree.match(tokens(range(2000, 2030)), {A}) == (30, A)


def test_an_empty_candidate_list_is_refused():
    with pytest.raises(ValueError):
        selector().select([], tokens(range(3)), {}, now=0)


def test_power_of_two_takes_the_less_loaded_of_two_distinct_workers():
    from kvmesh.router.scheduler import PowerOfTwoSelector

    loads = {A: 5.0, B: 1.0, C: 3.0}
    selector_ = PowerOfTwoSelector(random.Random(1))
    picks = [selector_.select([A, B, C], loads.__getitem__) for _ in range(300)]
    assert A not in picks  # the most loaded never wins a pair
    assert picks.count(B) > picks.count(C) > 0  # B wins both pairs it is drawn in, C one of two
    assert selector_.select([C], loads.__getitem__) == C


def test_a_cache_aware_policy_refuses_a_request_without_tokens_and_counts_requests_in_flight():
    from kvmesh.router.policy import RoutingPolicy

    policy = RoutingPolicy("cache-aware", 16, cache_aware=CacheAwareOptions(balance_abs_threshold=1))
    with pytest.raises(ValueError, match="tokens"):
        policy.choose([A, B], [], 10)
    for i in range(3):
        policy.active.add(f"r{i}", A, [], 10, 0)
    decision = policy.choose([A, B], [], 10, tokens=tokens(range(10)), now=0)
    assert decision.worker == B  # 3 - 0 > 1 and 3 > 0 × 1.5: imbalanced, the idle worker wins
