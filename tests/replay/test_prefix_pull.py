"""A saturated holder's prefix is pulled over the KV transfer in the replay (docs/decisions/0070): the
request waits for the transfer, then finds the blocks cached on its worker, and the fleet's tail
is shorter than when every request piles onto the holder or recomputes the prefix; the oracle index
prices a pull only of blocks already computed."""

from __future__ import annotations

from kvmesh.common.wire.hashing import local_block_hashes, sequence_hashes
from kvmesh.common.wire.worker_key import WorkerKey
from kvmesh.replay.config import ReplayConfig
from kvmesh.replay.mooncake_trace import TraceRequest
from kvmesh.replay.report import summarise
from kvmesh.replay.simulator import ReplaySimulator
from kvmesh.replay.virtual_index import VirtualIndex
from kvmesh.worker.engine import EngineRequestSpec
from kvmesh.worker.engines.mock.mock_engine import EngineConfig, MockEngine

SMALL = {"block_size": 16, "trace_block_size": 32, "num_blocks": 4096, "max_num_batched_tokens": 1024}


def one_hot_prefix(requests: int = 160, gap_ms: float = 4.0, anonymous: bool = False) -> list[TraceRequest]:
    """Requests sharing one 12-block prefix, each with 2 blocks of its own, faster than one worker
    serves them: the prefix's holder saturates. Each names a session of its own (decision 71: only
    a named session's prefix is pulled), or none with ``anonymous``."""
    shared = tuple(range(12))
    return [
        TraceRequest(i * gap_ms, 14 * 32, 8, (*shared, 1000 + 2 * i, 1001 + 2 * i), None if anonymous else f"s{i}")
        for i in range(requests)
    ]


def replay(anonymous: bool = False, **options):
    """The hot prefix on 4 workers; pulls where the holder is past the default 1.5 times the others'
    mean (decision 71)."""
    config = ReplayConfig(**{**SMALL, "workers": 4, **options})
    config.validate()
    return config, ReplaySimulator(config).run(one_hot_prefix(anonymous=anonymous))


def test_a_saturated_holder_s_prefix_is_pulled_and_found_cached_after_the_transfer():
    config, records = replay()
    pulled = [r for r in records if r.pulled_tokens]
    assert pulled, "no request pulled the hot prefix"
    assert all(r.worker != records[0].worker for r in pulled), "the first holder pulled its own prefix"
    for r in pulled:
        # the blocks arrived before the prefill: what was pulled is what the worker did not compute
        assert r.cached_tokens >= r.pulled_tokens
        assert r.ttft_ms >= config.kv_transfer_ms(r.pulled_tokens // config.block_size)


def test_pulls_shorten_the_tail_where_the_holder_saturates():
    _, with_pulls = replay()
    _, without = replay(kv_pull_ratio=0.0)
    assert not any(r.pulled_tokens for r in without)
    shorter, longer = summarise(with_pulls), summarise(without)
    assert shorter["ttft_ms"]["p99"] < longer["ttft_ms"]["p99"]
    assert shorter["prefix_reuse"] >= longer["prefix_reuse"]
    # the report tells how much of the reuse was pulled from another worker's cache
    assert 0 < shorter["pulled_share"] <= shorter["prefix_reuse"]
    assert longer["pulled_share"] == 0


def test_an_anonymous_shared_prefix_is_not_pulled():
    # decision 71: copied, it would stay a second copy of a prefix many requests share
    _, records = replay(anonymous=True)
    assert not any(r.pulled_tokens for r in records)


def test_the_oracle_counts_blocks_being_computed_but_offers_a_pull_only_those_computed():
    engine = MockEngine(EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=32))
    prompt = list(range(16 * 6))
    hashes = sequence_hashes(local_block_hashes(prompt, 16))
    engine.add_request(EngineRequestSpec("r", prompt, max_tokens=1))
    engine.step()  # a 32-token step: 2 of the 6 blocks computed, the other 4 still being computed
    answer = VirtualIndex(0.0).oracle(hashes, [WorkerKey(1, 0)], lambda _worker: engine)
    assert answer.matched == {WorkerKey(1, 0): 6}  # where the prefix will be: what routing weighs
    assert answer.held == {WorkerKey(1, 0): 2}  # what exists to pull now
