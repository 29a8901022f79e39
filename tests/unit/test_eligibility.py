"""Which workers may take a request: pure filters, one typed reason per exclusion."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvmesh.router.eligibility import (
    BusyThresholds,
    Exclusion,
    FailedWorkers,
    not_busy,
    prefill_workers,
    whole_request_workers,
)


@dataclass(frozen=True)
class Worker:
    instance_id: int
    model: str = "m"
    role: str = "aggregated"
    block_size: int = 16
    extra: dict[str, Any] = field(default_factory=dict)


def ids(workers) -> list[int]:
    return [w.instance_id for w in workers]


def test_whole_requests_go_to_workers_of_the_model_that_are_not_prefill_only():
    workers = [Worker(1), Worker(2, model="other"), Worker(3, role="prefill"), Worker(4, role="decode")]
    result = whole_request_workers(workers, "m", FailedWorkers(5.0), now=0.0)
    assert ids(result.eligible) == [1, 4]
    assert result.excluded == {2: Exclusion.OTHER_MODEL, 3: Exclusion.PREFILL_ROLE}


def test_a_request_naming_a_lora_adapter_goes_only_to_workers_that_serve_it():
    workers = [
        Worker(1, extra={"lora_adapters": ["sql"]}),
        Worker(2),
        Worker(3, role="prefill", extra={"lora_adapters": ["sql"]}),
    ]
    result = whole_request_workers(workers, "m", FailedWorkers(5.0), now=0.0, lora="sql")
    assert ids(result.eligible) == [1] and result.excluded[2] == Exclusion.NO_ADAPTER
    assert ids(whole_request_workers(workers, "m", FailedWorkers(5.0), now=0.0).eligible) == [1, 2]  # base: all
    assert ids(prefill_workers(workers, "m", 16, FailedWorkers(5.0), now=0.0, lora="sql").eligible) == [3]
    assert not prefill_workers(workers, "m", 16, FailedWorkers(5.0), now=0.0, lora="chat").eligible


def test_a_recently_failed_worker_is_left_out_until_its_time_is_up_unless_none_other_is_left():
    failed = FailedWorkers(avoid_secs=5.0)
    failed.mark(1, now=100.0)
    workers = [Worker(1), Worker(2)]
    result = whole_request_workers(workers, "m", failed, now=101.0)
    assert ids(result.eligible) == [2] and result.excluded == {1: Exclusion.RECENTLY_FAILED}
    assert ids(whole_request_workers(workers, "m", failed, now=105.5).eligible) == [1, 2]
    # alone, a failed worker is still better than no worker
    assert ids(whole_request_workers([Worker(1)], "m", failed, now=101.0).eligible) == [1]
    failed.forget(1)
    assert 1 not in failed.avoiding(now=101.0)


def test_the_prefill_pool_needs_the_role_the_model_the_block_size_and_no_recent_failure():
    failed = FailedWorkers(5.0)
    failed.mark(5, now=0.0)
    workers = [
        Worker(1, role="prefill"),
        Worker(2, role="decode"),
        Worker(3, role="prefill", model="other"),
        Worker(4, role="prefill", block_size=32),
        Worker(5, role="prefill"),
    ]
    result = prefill_workers(workers, "m", 16, failed, now=1.0)
    assert ids(result.eligible) == [1]
    assert result.excluded == {
        2: Exclusion.NOT_PREFILL_ROLE,
        3: Exclusion.OTHER_MODEL,
        4: Exclusion.OTHER_BLOCK_SIZE,
        5: Exclusion.RECENTLY_FAILED,
    }
    # unlike whole requests, a prefill pool of failed workers is empty: the request prefills locally
    assert prefill_workers([Worker(5, role="prefill")], "m", 16, failed, now=1.0).eligible == []


def test_busy_thresholds_exclude_workers_over_either_limit():
    loads = {1: (100, 10), 2: (5000, 10), 3: (100, 900)}  # worker -> (prefill tokens, decode blocks)
    thresholds = BusyThresholds(active_decode_blocks=500, active_prefill_tokens=4000)
    result = not_busy([Worker(1), Worker(2), Worker(3)], loads.__getitem__, thresholds)
    assert ids(result.eligible) == [1]
    assert result.excluded == {2: Exclusion.BUSY, 3: Exclusion.BUSY}
    assert ids(not_busy([Worker(2), Worker(3)], loads.__getitem__, BusyThresholds()).eligible) == [2, 3]
