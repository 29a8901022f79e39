import random
from collections import Counter

import pytest

from kvmesh.common.core.timing import TimingModel
from kvmesh.router.active_sequences import ActiveSequences
from kvmesh.router.scheduler import (
    BlockCost,
    Candidate,
    KvSelector,
    PredictedTtftCost,
    RoundRobinSelector,
    candidate_cost,
    kv_cost,
    make_cost_model,
)

BLOCK = 16


def candidate(worker: int, prefill_blocks: float, decode_blocks: int, tree: int = 0) -> Candidate:
    return Candidate((worker, 0), int(prefill_blocks * BLOCK), decode_blocks, tree_size=tree)


def test_worked_example_from_the_design():
    # overlap weight 1; (prefill blocks, decode blocks) = (8, 10), (5, 5), (2, 9) cost 18, 10, 11
    candidates = [candidate(1, 8, 10), candidate(2, 5, 5), candidate(3, 2, 9)]
    assert [candidate_cost(c, BLOCK, 1.0) for c in candidates] == [18, 10, 11]
    assert KvSelector(BlockCost(BLOCK)).select(candidates, 1.0, 0.0).worker == (2, 0)


def test_overlap_weight_scales_prefill_only():
    assert kv_cost(4, 3, 2.0) == 11
    assert kv_cost(4, 3, 0.0) == 3


def test_temperature_zero_is_deterministic_and_ties_prefer_the_smaller_tree():
    selector = KvSelector(BlockCost(BLOCK), random.Random(0))
    tied = [candidate(1, 2, 2, tree=50), candidate(2, 2, 2, tree=10), candidate(3, 2, 2, tree=30)]
    assert {selector.select(tied, 1.0, 0.0).worker for _ in range(50)} == {(2, 0)}


def test_high_temperature_spreads_load():
    selector = KvSelector(BlockCost(BLOCK), random.Random(1))
    candidates = [candidate(1, 0, 10), candidate(2, 0, 12), candidate(3, 0, 14)]
    picks = Counter(selector.select(candidates, 1.0, 10.0).worker for _ in range(3000))
    assert set(picks) == {(1, 0), (2, 0), (3, 0)}
    assert picks[(1, 0)] > picks[(3, 0)]  # still biased toward the cheapest
    assert min(picks.values()) > 600


def test_round_robin_cycles_in_a_stable_order():
    rr = RoundRobinSelector()
    workers = [(3, 0), (1, 0), (2, 0)]
    assert [rr.select(workers)[0] for _ in range(6)] == [1, 2, 3, 1, 2, 3]


def started_together(policy, workers) -> None:
    """The fleet's first routing decision meets every worker of ``workers`` before any was written, so
    each one's write count starts at 0 (a worker met later starts at the others' mean)."""
    assert policy.active.written_column(list(workers)) == [0] * len(workers)


class TestPredictedTtftCost:
    model = PredictedTtftCost(BLOCK, max_num_batched_tokens=1000, capacity_tokens=100 * BLOCK)
    timing = TimingModel()

    def test_queued_prefill_is_costed_in_engine_steps(self):
        busy = Candidate((1, 0), prefill_tokens=2500, decode_blocks=0)
        expected = 2 * self.timing.prefill_ms(1000) + self.timing.prefill_ms(500)
        assert self.model.cost(busy, 1.0) == pytest.approx(expected)

    def test_each_step_carries_the_decode_work(self):
        decoding = Candidate((1, 0), prefill_tokens=2500, decode_blocks=50)
        idle = Candidate((1, 0), prefill_tokens=2500, decode_blocks=0)
        per_step = self.timing.decode_ms(50 * BLOCK, 100 * BLOCK, True)
        assert self.model.cost(decoding, 1.0) - self.model.cost(idle, 1.0) == pytest.approx(3 * per_step)

    def test_a_cached_prefix_beats_a_big_decode_load_unlike_the_block_cost(self):
        # worker 1 holds most of the prompt but runs many requests; worker 2 is idle and cold
        model = PredictedTtftCost(BLOCK, max_num_batched_tokens=1000, capacity_tokens=1000 * BLOCK)
        warm_busy = Candidate((1, 0), prefill_tokens=200, decode_blocks=300)
        cold_idle = Candidate((2, 0), prefill_tokens=3000, decode_blocks=0)
        assert KvSelector(model).select([warm_busy, cold_idle], 1.0, 0.0).worker == (1, 0)
        assert KvSelector(BlockCost(BLOCK)).select([warm_busy, cold_idle], 1.0, 0.0).worker == (2, 0)

    def test_factory_knows_both_models(self):
        assert make_cost_model("blocks", 16, 8192, 100).name == "blocks"
        assert make_cost_model("ttft", 16, 8192, 100).name == "ttft"
        with pytest.raises(ValueError):
            make_cost_model("magic", 16, 8192, 100)


def test_no_candidates_is_an_error():
    with pytest.raises(ValueError):
        KvSelector(BlockCost(BLOCK)).select([], 1.0, 0.0)


class TestActiveSequences:
    def test_prefill_completion_lowers_a_workers_cost(self):
        active = ActiveSequences(BLOCK)
        active.add("r1", (1, 0), block_hashes=[11, 12, 13, 14], prompt_tokens=64, overlap_blocks=1)
        assert active.load((1, 0)) == (48, 4)
        active.mark_prefill_completed("r1")
        assert active.load((1, 0)) == (0, 4)
        active.free("r1")
        assert active.load((1, 0)) == (0, 0)

    def test_a_shared_prefix_counts_once(self):
        active = ActiveSequences(BLOCK)
        active.add("a", (1, 0), [1, 2, 3], prompt_tokens=50, overlap_blocks=0)  # 3 full + 1 partial
        active.add("b", (1, 0), [1, 2, 4], prompt_tokens=50, overlap_blocks=2)
        assert active.load((1, 0)) == (50 + 18, 4 + 2)
        active.free("a")
        assert active.load((1, 0)) == (18, 4)

    def test_potential_loads_add_only_new_blocks(self):
        active = ActiveSequences(BLOCK)
        active.add("a", (1, 0), [1, 2], prompt_tokens=32, overlap_blocks=0)
        loads = active.potential_loads([(1, 0), (2, 0)], [1, 2, 3], 48, {(1, 0): 2})
        assert [(p.prefill_tokens, p.decode_blocks) for p in loads] == [(32 + 16, 3), (48, 3)]

    def test_prefixes_in_flight_count_as_held_only_when_asked(self):
        active = ActiveSequences(BLOCK)
        active.add("a", (1, 0), [1, 2], prompt_tokens=32, overlap_blocks=0)  # 32 tokens queued on (1, 0)
        given = {(2, 0): 1}
        plain = active.potential_columns([(1, 0), (2, 0)], [1, 2, 3], 48, given)
        assert plain.held == [0, 1] and plain.overlaps is given
        assert plain.prefills == [32 + 48, 48 - 16]
        merged = active.potential_columns([(1, 0), (2, 0)], [1, 2, 3], 48, given, in_flight=True)
        # (1, 0) computes blocks 1 and 2 for "a" ahead of this request: only block 3 is left to it
        assert merged.held == [2, 1] and merged.overlaps == {(1, 0): 2, (2, 0): 1}
        assert merged.prefills == [32 + 16, 48 - 16] and merged.decodes == plain.decodes == [3, 3]
        assert given == {(2, 0): 1}  # the caller's mapping is left as it was

    def test_removing_a_worker_drops_its_requests(self):
        active = ActiveSequences(BLOCK)
        active.add("a", (1, 0), [1], 16, 0)
        active.remove_worker(1)
        assert active.load((1, 0)) == (0, 0) and len(active) == 0
        active.free("a")  # freeing a forgotten request is harmless


class TestRoutingPolicy:
    def test_per_request_overrides_apply_to_that_request_only(self):
        from kvmesh.router.policy import RoutingPolicy

        policy = RoutingPolicy("kv", BLOCK, overlap_score_weight=1.0, rng=random.Random(0))
        workers = [(1, 0), (2, 0)]
        hashes = list(range(100, 110))  # 10 blocks
        policy.active.add("busy", (2, 0), [900 + i for i in range(5)], 5 * BLOCK, 5)  # some decoding load on 2
        overlaps = {(1, 0): 0, (2, 0): 10}  # worker 2 holds the whole prompt
        assert policy.choose(workers, hashes, 10 * BLOCK, overlaps).worker == (2, 0)
        # with the prefill term weighed 0 the decode load decides; the next request is back to default
        assert policy.choose(workers, hashes, 10 * BLOCK, overlaps, overlap_score_weight=0.0).worker == (1, 0)
        assert policy.choose(workers, hashes, 10 * BLOCK, overlaps).worker == (2, 0)

    def test_the_duplicate_penalty_keeps_a_prefix_where_it_is_held_and_charges_only_copies(self):
        from kvmesh.router.policy import RoutingPolicy

        idle, holder, busier_holder = (1, 0), (2, 0), (3, 0)
        hashes = list(range(100, 110))  # 10 blocks, the first 4 held by two workers
        overlaps = {holder: 4, busier_holder: 4}

        def choice(penalty: float, this_request: float | None = None) -> tuple[int, int]:
            policy = RoutingPolicy("kv", BLOCK, rng=random.Random(0), duplicate_penalty=penalty)
            policy.active.add("queued", holder, [900 + i for i in range(6)], 6 * BLOCK, 0)
            policy.active.add("queued more", busier_holder, [800 + i for i in range(12)], 12 * BLOCK, 0)
            workers = [idle, holder, busier_holder]
            return policy.choose(workers, hashes, 10 * BLOCK, overlaps, duplicate_penalty=this_request).worker

        assert choice(0.0) == idle  # the copy is cheaper than the holder's queue
        # copying 4 held blocks now costs 8 more blocks of prefill: the less busy holder keeps it
        assert choice(2.0) == holder
        assert choice(8.0) == holder  # holders are never charged against each other
        assert choice(8.0, this_request=0.0) == idle  # a loop's turn is not charged (the router decides)
        assert choice(0.0, this_request=2.0) == holder

    def test_with_the_penalty_a_prefix_a_worker_has_in_flight_counts_as_held_there(self):
        from kvmesh.router.policy import RoutingPolicy

        idle, computing = (1, 0), (2, 0)
        hashes = list(range(100, 110))  # 10 blocks; no worker has cached any yet (the index says 0)

        def choice(penalty: float) -> tuple[int, int]:
            policy = RoutingPolicy("kv", BLOCK, rng=random.Random(0), duplicate_penalty=penalty)
            # a sibling with the same first 8 blocks was just sent to `computing` and waits there
            policy.active.add("sibling", computing, hashes[:8], 8 * BLOCK, 0)
            return policy.choose([idle, computing], hashes, 10 * BLOCK, {}).worker

        assert choice(0.0) == idle  # kv alone: the index shows nothing, the idle worker is cheaper
        assert choice(2.0) == computing  # the sibling computes the 8 blocks first: copying them costs

    def test_the_penalty_does_not_hold_a_prefix_on_a_holder_far_busier_than_another(self):
        from kvmesh.router.cache_aware import CacheAwareOptions
        from kvmesh.router.policy import RoutingPolicy

        joined, holder = (1, 0), (2, 0)  # a worker that just joined, and the one holding every prefix
        hashes = list(range(100, 110))

        def choice(in_flight: int) -> tuple[int, int]:
            balance = CacheAwareOptions(balance_abs_threshold=8, balance_rel_threshold=1.5)
            policy = RoutingPolicy("kv", BLOCK, rng=random.Random(0), cache_aware=balance, duplicate_penalty=128.0)
            for i in range(in_flight):  # decoding, their prompts' blocks cached there
                policy.active.add(f"r{i}", holder, [900 + i], BLOCK, 1)
            return policy.choose([joined, holder], hashes, 10 * BLOCK, {holder: 8}).worker

        assert choice(8) == holder  # 8 more in flight: within the balance test, the penalty holds it
        assert choice(9) == joined  # one more and the loads are imbalanced: kv's cost alone decides

    def test_the_penalty_does_not_hold_a_mostly_new_prompt_on_the_holder_of_its_short_prefix(self):
        from kvmesh.router.cache_aware import CacheAwareOptions
        from kvmesh.router.policy import RoutingPolicy

        idle, holder = (1, 0), (2, 0)
        hashes = list(range(100, 110))  # 10 blocks

        def choice(held: int, threshold: float = 0.3) -> tuple[int, int]:
            options = CacheAwareOptions(cache_threshold=threshold)
            policy = RoutingPolicy("kv", BLOCK, rng=random.Random(0), cache_aware=options, duplicate_penalty=128.0)
            policy.active.add("queued", holder, [900 + i for i in range(6)], 6 * BLOCK, 0)
            return policy.choose([idle, holder], hashes, 10 * BLOCK, {holder: held}).worker

        assert choice(4) == holder  # 40% of the prompt held: the penalty keeps it there
        assert choice(3) == idle  # 30%, not more than the threshold: a miss, the idle worker computes it sooner
        assert choice(3, threshold=0.2) == holder
        assert choice(0) == idle

    def test_a_mostly_new_prompt_goes_to_an_under_written_worker_within_reach(self):
        from kvmesh.router.policy import RoutingPolicy

        quiet, busy, other = (1, 0), (2, 0), (3, 0)
        hashes = list(range(100, 110))  # 10 blocks, none held anywhere: a mostly new prompt

        def choice(
            spread: float, quiet_queue: int, quiet_written: int = 0, joined_late: bool = False
        ) -> tuple[int, int]:
            policy = RoutingPolicy("kv", BLOCK, rng=random.Random(0), duplicate_penalty=128.0, write_spread=spread)
            started_together(policy, (busy, other) if joined_late else (busy, other, quiet))
            for n, worker in enumerate((busy, other)):  # both have computed 40 blocks and finished
                policy.active.add(f"old{n}", worker, [], 40 * BLOCK, 0)
                policy.active.free(f"old{n}")
            policy.active.add("done", quiet, [], quiet_written, 0)
            policy.active.free("done")
            policy.active.add("queued", quiet, [900 + i for i in range(quiet_queue)], quiet_queue * BLOCK, 0)
            return policy.choose([busy, other, quiet], hashes, 10 * BLOCK).worker

        assert choice(0.0, quiet_queue=2) in (busy, other)  # off: the idle workers compute it soonest
        assert choice(0.75, quiet_queue=2) == quiet  # never written, and its short queue is within reach
        # the same worker joining after the others were written starts at their mean: cost decides
        assert choice(0.75, quiet_queue=2, joined_late=True) in (busy, other)
        assert choice(0.75, quiet_queue=40) in (busy, other)  # a queue 5x the prompt: out of reach
        # written 25 blocks and 2 queued: 27 is not under 0.75 of the mean of (40, 40, 27), 26.75: cost decides
        assert choice(0.75, quiet_queue=2, quiet_written=25 * BLOCK) in (busy, other)
        assert choice(0.75, quiet_queue=2, quiet_written=24 * BLOCK) == quiet  # 26 < 26.5

    def test_a_well_matched_prompt_is_not_spread(self):
        from kvmesh.router.policy import RoutingPolicy

        holder, fresh = (1, 0), (2, 0)
        hashes = list(range(100, 110))
        policy = RoutingPolicy("kv", BLOCK, rng=random.Random(0), duplicate_penalty=128.0, write_spread=0.75)
        started_together(policy, (holder, fresh))
        policy.active.add("old", holder, [], 40 * BLOCK, 0)
        policy.active.free("old")
        assert policy.choose([holder, fresh], hashes, 10 * BLOCK, {holder: 8}).worker == holder

    def test_the_spread_does_not_take_a_prompt_off_the_worker_that_holds_more_of_it(self):
        from kvmesh.router.policy import RoutingPolicy

        holder, other, quiet = (1, 0), (2, 0), (3, 0)
        hashes = list(range(100, 110))  # 10 blocks; the holder has the first 2: 20%, a mostly new prompt

        def choice(held_by_quiet: int) -> tuple[int, int]:
            policy = RoutingPolicy("kv", BLOCK, rng=random.Random(0), duplicate_penalty=128.0, write_spread=0.75)
            started_together(policy, (holder, other, quiet))
            for n, worker in enumerate((holder, other)):
                policy.active.add(f"old{n}", worker, [], 40 * BLOCK, 0)
                policy.active.free(f"old{n}")
            overlaps = {holder: 2, quiet: held_by_quiet}
            return policy.choose([holder, other, quiet], hashes, 10 * BLOCK, overlaps).worker

        assert choice(held_by_quiet=0) == holder  # quiet is under-written and within reach, but holds less
        assert choice(held_by_quiet=2) == quiet  # holding as much, it takes the write

    def test_a_well_matched_prompt_stays_with_the_cheaper_of_equal_holders(self):
        from kvmesh.router.policy import RoutingPolicy

        busy, quiet = (1, 0), (2, 0)
        hashes = list(range(100, 110))  # both hold 4 of its 10 blocks: 40%, not a mostly new prompt
        policy = RoutingPolicy("kv", BLOCK, rng=random.Random(0), duplicate_penalty=128.0, write_spread=0.75)
        started_together(policy, (busy, quiet))
        policy.active.add("old", busy, [], 40 * BLOCK, 0)
        policy.active.free("old")
        policy.active.add("queued", quiet, [900], BLOCK, 0)  # quiet: under-written, a block queued
        assert policy.choose([busy, quiet], hashes, 10 * BLOCK, {busy: 4, quiet: 4}).worker == busy

    def test_the_write_count_is_per_worker_and_goes_with_it(self):
        active = ActiveSequences(BLOCK)
        assert active.written_column([(1, 0), (2, 0)]) == [0, 0]  # met together: both start at 0
        active.add("a", (1, 0), [], prompt_tokens=5 * BLOCK, overlap_blocks=2)
        active.add("b", (1, 0), [], prompt_tokens=BLOCK, overlap_blocks=0)
        active.free("a")
        # uncached tokens only, and freeing keeps the count
        assert active.written_column([(1, 0), (2, 0)]) == [4 * BLOCK, 0]
        active.remove_worker(1)
        assert active.written_column([(1, 0)]) == [0]  # gone with it: met again at the others' mean, 0

    def test_a_worker_met_after_writes_starts_at_the_mean(self):
        active = ActiveSequences(BLOCK)
        active.add("a", (1, 0), [], prompt_tokens=4 * BLOCK, overlap_blocks=0)  # nothing counted yet: from 0
        active.add("b", (2, 0), [], prompt_tokens=2 * BLOCK, overlap_blocks=0)  # met by a request: from 4
        assert active.written_column([(1, 0), (2, 0)]) == [4 * BLOCK, 6 * BLOCK]
        assert active.written_column([(3, 0)]) == [5 * BLOCK]  # met by a decision, and counted from then on
        active.add("c", (3, 0), [], prompt_tokens=BLOCK, overlap_blocks=0)
        assert active.written_column([(3, 0)]) == [6 * BLOCK]
        active.remove_worker(1)
        assert active.written_column([(1, 0)]) == [6 * BLOCK]  # back again: a joiner like any other


class TestActiveSequenceTracking:
    def test_output_blocks_grow_with_the_output_and_start_at_the_hint(self):
        active = ActiveSequences(BLOCK, track_output_blocks=True)
        active.add("r", (1, 0), [1, 2], prompt_tokens=40, overlap_blocks=0, expected_output_tokens=30)
        assert active.load((1, 0))[1] == -(-(40 + 30) // BLOCK)  # 5 blocks expected from the start
        active.add_output("r", 30)
        assert active.load((1, 0))[1] == 5
        active.add_output("r", 20)  # longer than expected: 90 tokens
        assert active.load((1, 0))[1] == 6
        active.free("r")
        assert active.load((1, 0)) == (0, 0)

    def test_output_is_ignored_unless_tracked(self):
        active = ActiveSequences(BLOCK)
        active.add("r", (1, 0), [1, 2], prompt_tokens=40, overlap_blocks=0, expected_output_tokens=300)
        active.add_output("r", 500)
        assert active.load((1, 0))[1] == 3

    def test_untracked_active_blocks_cost_nothing(self):
        active = ActiveSequences(BLOCK, track_active_blocks=False)
        active.add("r", (1, 0), [1, 2, 3], prompt_tokens=48, overlap_blocks=0)
        assert active.load((1, 0)) == (48, 0)
        assert active.potential_loads([(1, 0)], [1, 2, 3], 48, {})[0].decode_blocks == 0

    def test_stale_requests_expire(self):
        active = ActiveSequences(BLOCK)
        active.add("old", (1, 0), [1], 16, 0, now=0.0)
        active.add("new", (1, 0), [2], 16, 0, now=50.0)
        assert active.expire(now=100.0, max_age=60.0) == ["old"]
        assert "new" in active and "old" not in active


def test_active_prefix_counts_exactly_what_a_scan_counts():
    from kvmesh.router.active_sequences import _active_prefix

    rng = random.Random(5)
    for _ in range(200):
        n = rng.randrange(0, 40)
        chain = list(range(1000, 1000 + n))
        active = {h: 1 for h in chain[: rng.randrange(0, n + 1)]}  # active sets are prefixes
        assert _active_prefix(active, chain) == sum(1 for h in chain if h in active)


def test_the_column_wise_ttft_cost_is_the_timing_models_formula_in_both_paths():
    import random as random_module

    from kvmesh.common.core.timing import TimingModel
    from kvmesh.router.scheduler import VECTORISE_FROM, PredictedTtftCost

    timing = TimingModel()
    cost = PredictedTtftCost(16, 8192, 16384 * 16, timing)

    def reference(prefill: int, blocks: int, weight: float) -> float:
        full, remainder = divmod(prefill, 8192)
        prefill_ms = full * timing.prefill_ms(8192) + timing.prefill_ms(remainder)
        steps = max(1, full + (1 if remainder else 0))
        return weight * prefill_ms + steps * timing.decode_ms(blocks * 16, 16384 * 16, blocks > 0)

    rng = random_module.Random(7)
    for count in (3, VECTORISE_FROM + 5):  # the loop, then numpy
        prefills = [rng.choice([0, 1, 8191, 8192, 8193, rng.randrange(0, 40_000)]) for _ in range(count)]
        blocks = [rng.choice([0, 1, rng.randrange(0, 40_000)]) for _ in range(count)]
        workers = [(i, 0) for i in range(count)]
        got = cost.costs(workers, prefills, blocks, 0.7)
        assert got == pytest.approx([reference(p, b, 0.7) for p, b in zip(prefills, blocks, strict=True)], rel=1e-12)


def test_per_worker_costs_use_each_workers_own_model_and_the_prior_for_the_rest():
    from kvmesh.common.core.timing import TimingModel, scaled
    from kvmesh.router.scheduler import Candidate, PerWorkerTtftCost, PredictedTtftCost

    cost = PerWorkerTtftCost(16, 8192, 16384 * 16, TimingModel())
    slow = scaled(TimingModel(), 3.0)
    cost.set_timing((1, 0), slow)
    workers = [(0, 0), (1, 0), (2, 0)]
    prefills, blocks = [100, 100, 9000], [50, 50, 0]
    got = cost.costs(workers, prefills, blocks, 1.0)
    prior, own = PredictedTtftCost(16, 8192, 16384 * 16, TimingModel()), PredictedTtftCost(16, 8192, 16384 * 16, slow)
    expected = [
        prior.cost(Candidate((0, 0), 100, 50), 1.0),
        own.cost(Candidate((1, 0), 100, 50), 1.0),
        prior.cost(Candidate((2, 0), 9000, 0), 1.0),
    ]
    assert got == expected and got[1] > got[0]
