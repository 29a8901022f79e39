import dataclasses

import pytest

from kvmesh.common.core.tiny_model import MODEL_DIR
from kvmesh.frontend.tokenizer import ModelTokenizer
from kvmesh.loadgen.workload import (
    TracePromptBuilder,
    as_sent,
    check_shared_prefixes,
    synthetic_workload,
    trace_workload,
)
from kvmesh.replay.bounds import reuse_bounds
from kvmesh.replay.mooncake_trace import TraceRequest


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(MODEL_DIR)


TRACE = [
    TraceRequest(0, 150, 4, (1, 2, 3)),
    TraceRequest(500, 100, 4, (1, 2)),
    TraceRequest(900, 120, 4, (7, 2, 3)),
]


def test_trace_prompts_tokenise_to_shared_blocks(tokenizer):
    builder = TracePromptBuilder(tokenizer, trace_block_size=64)
    requests = trace_workload(TRACE, builder, arrival_speedup_ratio=2.0, max_output_tokens=None)
    ids = [tokenizer.encode(r.prompt) for r in requests]
    assert [len(i) for i in ids] == [150, 100, 120] == [r.prompt_tokens for r in requests]
    assert ids[0][:100] == ids[1]  # hash ids (1, 2) shared
    assert ids[0][64:120] == ids[2][64:120] and ids[0][:64] != ids[2][:64]  # block 2 same, prefix differs
    assert [r.send_at_s for r in requests] == [0.0, 0.25, 0.45]
    assert check_shared_prefixes(tokenizer, requests, 64).mismatched == 0


def test_prefix_check_catches_prompts_that_do_not_line_up(tokenizer):
    builder = TracePromptBuilder(tokenizer, trace_block_size=64)
    requests = trace_workload(TRACE, builder, 1.0, max_output_tokens=2)
    broken = dataclasses.replace(requests[1], prompt="x" + requests[1].prompt)
    check = check_shared_prefixes(tokenizer, [requests[0], broken], 64)
    assert check.mismatched == 1 and check.first_mismatch == broken.index
    assert all(r.max_tokens == 2 for r in requests)


def test_synthetic_workload_shares_a_prefix_per_group(tokenizer):
    requests = synthetic_workload(
        tokenizer, 12, num_prefixes=3, prefix_tokens=128, suffix_tokens=16, output_tokens=5, seed=1
    )
    groups = {r.hash_ids[0] for r in requests}
    assert groups <= {0, 1, 2} and len(groups) > 1
    assert all(r.prompt_tokens == 144 and len(tokenizer.encode(r.prompt)) == 144 for r in requests)
    assert check_shared_prefixes(tokenizer, requests, 128).mismatched == 0


def test_priority_classes_are_drawn_reproducibly_from_the_mix():
    from kvmesh.loadgen.workload import BenchRequest, assign_priorities

    requests = [BenchRequest(i, None, "p", 1, 1) for i in range(1000)]
    drawn = assign_priorities(requests, {"high": 0.2, "low": 0.8}, seed=3)
    assert drawn == assign_priorities(requests, {"high": 0.2, "low": 0.8}, seed=3)
    highs = sum(r.priority == "high" for r in drawn)
    assert 150 < highs < 250 and all(r.priority in ("high", "low") for r in drawn)


def test_the_report_counts_refusals_by_status_and_gives_each_class_its_ttft():
    from kvmesh.loadgen.report import build_report
    from kvmesh.loadgen.runner import RequestResult

    results = [
        RequestResult(0, 0.0, 10, first_token_s=0.1, done_s=0.2, priority="high"),
        RequestResult(1, 0.0, 10, first_token_s=2.0, done_s=2.5, priority="low"),
        RequestResult(2, 0.0, 10, error="RateLimitError", status=429, retry_after="3", priority="low"),
        RequestResult(3, 0.0, 10, error="InternalServerError", status=503, priority="low"),
    ]
    report = build_report("run", {}, results, None)
    assert report["refusals"] == {
        "429": {"count": 1, "with_retry_after": 1},
        "503": {"count": 1, "with_retry_after": 0},
    }
    assert report["by_priority"]["high"]["ttft_ms"]["p50"] == pytest.approx(100)
    assert report["by_priority"]["low"]["completed"] == 1 and report["by_priority"]["low"]["requests"] == 3


def test_a_prompt_is_cut_to_its_hash_ids_and_as_sent_says_so(tokenizer):
    builder = TracePromptBuilder(tokenizer, trace_block_size=64)
    longer = [*TRACE, TraceRequest(1000, 5000, 4, (1, 9))]  # 5,000 tokens named, 2 hash ids: 128 sent
    sent = as_sent(longer, 64)
    assert [len(builder.prompt(row)[1]) for row in longer] == [row.input_length for row in sent]
    assert [row.input_length for row in sent] == [150, 100, 120, 128]
    assert [row.hash_ids for row in sent] == [row.hash_ids for row in longer]


def test_a_windows_bound_is_read_off_its_prompts_as_sent():
    # 512-token trace blocks sent as 32 tokens each: the second prompt is 96 tokens, 64 of them the first's
    window = [TraceRequest(0, 1024, 4, (1, 2)), TraceRequest(100, 1536, 4, (1, 2, 3))]
    bounds = reuse_bounds(as_sent(window, 32), 32, 32, capacity_blocks=1024)
    assert bounds.infinite == pytest.approx(64 / (64 + 96))
    assert reuse_bounds(window, 32, 32, capacity_blocks=1024).infinite < 0.03  # the trace's lengths: 64 of 2,560
