"""The mock engine's host tier (kvmesh.worker.engines.mock.host_tier): evicted blocks are offloaded with the
ancestors they need, reloaded for a later request at a cost, and described exactly by tier-``host``
events that an index applies as the worker's host dp rank."""

from __future__ import annotations

import pytest

from kvmesh.common.core.prefix_index import PrefixIndex
from kvmesh.common.wire.hashing import local_block_hashes, sequence_hashes
from kvmesh.common.wire.kv_events import HOST_TIER, BlocksRemoved, BlocksStored, KvEvent, KvEventBatch
from kvmesh.common.wire.worker_key import TierKey
from kvmesh.worker.engines.mock.host_tier import HostTier
from kvmesh.worker.engines.mock.mock_engine import EngineConfig, EngineRequestSpec, MockEngine
from tests.unit.test_mock_engine import run_to_completion

PROMPT = list(range(100))  # 6 full blocks of 16


def engine(host_blocks: int = 32) -> MockEngine:
    return MockEngine(EngineConfig(num_blocks=12, block_size=16, host_blocks=host_blocks))


def evict_everything(mock: MockEngine) -> None:
    for i in range(3):  # other prompts that need the whole device pool
        mock.add_request(EngineRequestSpec(f"other{i}", [5000 * (i + 1) + t for t in range(150)], max_tokens=2))
        run_to_completion(mock)


def test_an_evicted_prompt_is_reloaded_from_the_host_tier_and_counted_as_cached():
    mock = engine()
    mock.add_request(EngineRequestSpec("a", PROMPT, max_tokens=2))
    first = run_to_completion(mock)
    evict_everything(mock)
    assert mock.blocks.cached_prefix_length(sequence_hashes(local_block_hashes(PROMPT, 16, None))) == 0
    mock.add_request(EngineRequestSpec("again", PROMPT, max_tokens=2))
    again = run_to_completion(mock)
    assert again[0].outputs[0].cached_tokens == 96  # all 6 blocks reloaded, none recomputed
    assert again[0].prefill_tokens == 4
    # a reload costs something, much less than the prefill it saves
    reload_ms = 96 * EngineConfig().host_reload_ms_per_token
    assert again[0].duration_ms == pytest.approx(mock.config.timing.prefill_ms(4) + reload_ms)
    assert again[0].duration_ms < first[0].duration_ms


def test_without_a_host_tier_the_evicted_prompt_is_computed_again():
    mock = engine(host_blocks=0)
    mock.add_request(EngineRequestSpec("a", PROMPT, max_tokens=2))
    run_to_completion(mock)
    evict_everything(mock)
    mock.add_request(EngineRequestSpec("again", PROMPT, max_tokens=2))
    assert run_to_completion(mock)[0].outputs[0].cached_tokens == 0
    assert mock.drain_host_events() == []


def test_host_events_build_rooted_chains_that_an_index_matches_as_the_host_tier():
    mock = engine(host_blocks=8)
    index = PrefixIndex()
    event_id = 0

    def apply_host_events() -> None:
        nonlocal event_id
        events = mock.drain_host_events()
        batch = tuple(KvEvent(event_id + i, data, "host") for i, data in enumerate(events))
        event_id += len(events)
        index.apply_batch(KvEventBatch(1, 0, 0.0, batch, HOST_TIER))

    mock.add_request(EngineRequestSpec("a", PROMPT, max_tokens=2))
    run_to_completion(mock)
    evict_everything(mock)
    apply_host_events()
    assert index.stats.unknown_parent == 0
    held = {block for block, _local, _parent in mock.cache.host.blocks()}
    assert len(held) <= 8
    for prompt in (PROMPT, *([5000 * (i + 1) + t for t in range(150)] for i in range(3))):
        hashes = sequence_hashes(local_block_hashes(prompt, 16, None))
        expected = mock.cache.host.run_length(hashes, 0)
        assert index.find_matches_by_sequence(hashes).get(TierKey(1, 0, HOST_TIER), 0) == expected


def test_the_tier_drops_least_recently_used_leaves_first_and_says_so():
    tier = HostTier(num_blocks=3, block_size=16)
    tier.offload([(1, 11, None), (2, 12, 1), (3, 13, 2)])
    tier.offload([(4, 14, None)])  # room for it: the tail of the older chain goes, never a parent first
    events = tier.drain_events()
    assert events[0] == BlocksStored(None, tuple(events[0].blocks)) and [b.block_hash for b in events[0].blocks] == [
        1,
        2,
        3,
    ]
    assert events[1] == BlocksRemoved((3,))
    assert [b.block_hash for b in events[2].blocks] == [4]
    assert [block for block, _, _ in tier.blocks()] == [1, 2, 4]
