import pytest

from kvmesh.common.core.timing import TimingModel
from kvmesh.common.wire.kv_events import BlocksRemoved, BlocksStored
from kvmesh.worker.engines.mock.mock_engine import (
    EngineConfig,
    EngineRequestError,
    EngineRequestSpec,
    FinishReason,
    MockEngine,
)


def run_to_completion(engine: MockEngine, limit: int = 10_000):
    steps = []
    while engine.has_work():
        steps.append(engine.step())
        assert len(steps) < limit
    return steps


def test_timing_model_uses_dynamos_published_constants():
    timing = TimingModel()
    assert timing.prefill_ms(0) == 0.0
    assert timing.prefill_ms(1000) == pytest.approx(4.209989e-7 * 1e6 + 1.518344e-2 * 1000 + 16.50142)
    assert timing.decode_ms(0, 1000, decoding=False) == 0.0
    assert timing.decode_ms(500, 1000, decoding=True) == pytest.approx(-25.74 * 0.25 + 54.01 * 0.5 + 5.74)
    assert timing.decode_ms(5000, 1000, decoding=True) == pytest.approx(max(1, -25.74 + 54.01 + 5.74))
    fast = TimingModel(speedup_ratio=4)
    assert fast.step_ms(1000, 500, 1000, True) == pytest.approx(timing.step_ms(1000, 500, 1000, True) / 4)


def test_first_token_lands_at_the_end_of_the_step_that_finishes_prefill():
    engine = MockEngine(EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=64))
    engine.add_request(EngineRequestSpec("r", list(range(150)), max_tokens=3))
    steps = run_to_completion(engine)
    # 150 prompt tokens at 64 per step: chunks of 64, 64, 22; the third step emits the first token
    assert [s.prefill_tokens for s in steps[:3]] == [64, 64, 22]
    assert [len(s.outputs) for s in steps] == [0, 0, 1, 1, 1]
    timing = TimingModel()
    assert steps[0].duration_ms == pytest.approx(timing.prefill_ms(64))
    assert steps[3].decoding_requests == 1
    assert steps[3].duration_ms == pytest.approx(timing.decode_ms(151, 64 * 16, True))  # context: 150 + 1
    assert steps[-1].outputs[0].finish_reason is FinishReason.LENGTH


def test_cached_prefix_is_not_recomputed_and_is_reported():
    engine = MockEngine(EngineConfig(num_blocks=64, block_size=16))
    prompt = list(range(100))  # 6 full blocks
    engine.add_request(EngineRequestSpec("a", prompt, max_tokens=2))
    run_to_completion(engine)
    engine.add_request(EngineRequestSpec("b", prompt, max_tokens=2))
    steps = run_to_completion(engine)
    assert steps[0].prefill_tokens == 100 - 96
    assert steps[0].outputs[0].cached_tokens == 96


def test_a_fully_cached_prompt_still_computes_one_token():
    engine = MockEngine(EngineConfig(num_blocks=64, block_size=16))
    engine.add_request(EngineRequestSpec("a", list(range(32)), max_tokens=1))
    run_to_completion(engine)
    engine.add_request(EngineRequestSpec("b", list(range(32)), max_tokens=1))
    steps = run_to_completion(engine)
    assert steps[0].outputs[0].cached_tokens == 16
    assert steps[0].prefill_tokens == 16


def test_output_is_deterministic_per_seed_and_prompt():
    def answer(seed: int, prompt: list[int]) -> list[int]:
        engine = MockEngine(EngineConfig(num_blocks=64, block_size=16))
        engine.add_request(EngineRequestSpec("x", prompt, max_tokens=8, seed=seed))
        return [o.token_id for s in run_to_completion(engine) for o in s.outputs]

    assert answer(1, [5, 6, 7]) == answer(1, [5, 6, 7])
    assert answer(1, [5, 6, 7]) != answer(2, [5, 6, 7])
    assert answer(1, [5, 6, 7]) != answer(1, [5, 6, 8])


def test_stop_token_ends_the_request():
    engine = MockEngine(EngineConfig(num_blocks=64, block_size=16, output_vocab=(7,)))
    engine.add_request(EngineRequestSpec("x", [1, 2, 3], max_tokens=50, stop_token_ids=[7]))
    outputs = [o for s in run_to_completion(engine) for o in s.outputs]
    assert len(outputs) == 1 and outputs[0].finish_reason is FinishReason.STOP


def test_events_describe_the_cache_exactly():
    engine = MockEngine(EngineConfig(num_blocks=8, block_size=16))
    seen: set[int] = set()
    for i in range(6):
        engine.add_request(EngineRequestSpec(f"r{i}", [i * 1000 + t for t in range(40)], max_tokens=4))
        run_to_completion(engine)
        for event in engine.drain_events():
            if isinstance(event, BlocksStored):
                seen |= {b.block_hash for b in event.blocks}
            elif isinstance(event, BlocksRemoved):
                seen -= set(event.block_hashes)
    assert seen == engine.blocks.cached_hashes()
    assert engine.blocks.num_cached <= 8


def test_running_sequences_are_preempted_last_in_first_out_when_memory_runs_out():
    engine = MockEngine(EngineConfig(num_blocks=6, block_size=16, max_num_batched_tokens=1000))
    engine.add_request(EngineRequestSpec("old", list(range(40)), max_tokens=30))  # grows to 70 tokens = 5 blocks
    engine.add_request(EngineRequestSpec("new", list(range(100, 140)), max_tokens=30))
    engine.step()
    assert [r.request_id for r in engine.running] == ["old", "new"]
    finished = {}
    preempted = False
    while engine.has_work():
        for output in engine.step().outputs:
            if output.finish_reason:
                finished[output.request_id] = output
        if "old" not in finished and any(r.request_id == "new" for r in engine.waiting):
            preempted = True
            assert [r.request_id for r in engine.running] == ["old"]  # the younger one made way
    assert preempted
    assert set(finished) == {"old", "new"}  # the preempted request still completes


def test_token_budget_and_sequence_limit_bound_a_step():
    engine = MockEngine(EngineConfig(num_blocks=256, block_size=16, max_num_seqs=2, max_num_batched_tokens=100))
    for i in range(3):
        engine.add_request(EngineRequestSpec(f"r{i}", [i] * 80, max_tokens=2))
    first = engine.step()
    assert first.prefill_tokens == 100  # 80 + a 20-token chunk of the second
    assert len(engine.running) == 2 and len(engine.waiting) == 1


def test_impossible_requests_are_rejected_up_front():
    engine = MockEngine(EngineConfig(num_blocks=4, block_size=16))
    with pytest.raises(EngineRequestError):
        engine.add_request(EngineRequestSpec("big", list(range(100)), max_tokens=1))
    with pytest.raises(EngineRequestError):
        engine.add_request(EngineRequestSpec("empty", [], max_tokens=1))


def test_abort_frees_blocks():
    engine = MockEngine(EngineConfig(num_blocks=16, block_size=16))
    engine.add_request(EngineRequestSpec("x", list(range(64)), max_tokens=100))
    engine.step()
    assert engine.blocks.num_active > 0
    assert engine.abort("x")
    assert engine.blocks.num_active == 0 and not engine.has_work()
    assert not engine.abort("x")


# ---- disaggregation: a prompt whose KV comes from another worker --------------------------------
TRANSFER_BLOCK, TRANSFER_BLOCKS = 16, 64
PROMPT = list(range(1000, 1100))  # 100 tokens: 6 transferable blocks


def make_engine() -> tuple[MockEngine, None]:
    return MockEngine(EngineConfig(num_blocks=TRANSFER_BLOCKS, block_size=TRANSFER_BLOCK)), None


def test_remote_prefill_without_memory_leaves_nothing_behind():
    engine, _ = make_engine()
    engine.add_request(
        EngineRequestSpec("big", list(range(TRANSFER_BLOCKS * TRANSFER_BLOCK - 8)), 8)
    )  # runs on, holding every block
    engine.step()
    assert engine.add_remote_prefill(EngineRequestSpec("d", PROMPT, 4)) is None
    assert "d" not in engine.transferring


def test_aborting_a_request_mid_transfer_frees_its_blocks():
    engine, _ = make_engine()
    plan = engine.add_remote_prefill(EngineRequestSpec("d", PROMPT, 4))
    assert plan is not None and engine.blocks.num_active == plan.num_blocks
    assert engine.abort("d")
    assert engine.blocks.num_active == 0
    engine.finish_transfer("d", True)  # a transfer ending after the abort is ignored
    assert not engine.has_work()
