"""How cached blocks of each tier are credited (kvmesh.common.core.tier_credits): the split of a
match by tier and the router's credit of it with its options."""

from __future__ import annotations

from kvmesh.common.core.index_answer import IndexAnswer
from kvmesh.common.core.tier_credits import credited_matches, offloaded_blocks
from kvmesh.common.wire.kv_events import DISK_TIER, HOST_TIER
from kvmesh.common.wire.worker_key import TierKey
from kvmesh.router.config import RouterConfig


def host(worker: int, rank: int = 0) -> TierKey:
    return TierKey(worker, rank, HOST_TIER)


def disk(worker: int, rank: int = 0) -> TierKey:
    return TierKey(worker, rank, DISK_TIER)


def test_the_host_tier_counts_past_the_device_match_and_the_disk_past_both():
    matched = {(1, 0): 4, host(1): 10, disk(1): 12, host(2): 3, disk(3): 2}
    on_host, on_disk = offloaded_blocks(matched)
    assert on_host == {(1, 0): 6, (2, 0): 3}
    assert on_disk == {(1, 0): 2, (3, 0): 2}
    # a tier that holds no more than the device adds nothing
    assert offloaded_blocks({(1, 0): 5, host(1): 5}) == ({}, {})


def test_each_rank_is_credited_its_own_offloaded_blocks():
    """Rank 1's host tier tops up rank 1's match, not rank 0's (tiers were once fake ranks of rank 0)."""
    matched = {(1, 0): 4, (1, 1): 2, host(1, 1): 9, disk(1, 0): 6}
    on_host, on_disk = offloaded_blocks(matched)
    assert on_host == {(1, 1): 7}
    assert on_disk == {(1, 0): 2}


def test_the_router_credits_each_tier_and_takes_the_better_of_host_and_pool():
    config = RouterConfig(host_block_credit=0.75, disk_block_credit=0.25, pooled_block_credit=0.9)
    view = IndexAnswer({(1, 0): 4, (2, 0): 0}, {}, pooled={(2, 0): 4}, host={(1, 0): 8, (2, 0): 4}, disk={(1, 0): 4})
    credited = credited_matches(view.matched, config.tier_credits(), pooled=view.pooled, host=view.host, disk=view.disk)
    assert credited == {(1, 0): 4 + 6 + 1, (2, 0): round(0.9 * 4)}
