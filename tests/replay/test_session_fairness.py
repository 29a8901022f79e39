"""Fair service between sessions in the router queue (``--router-queue-policy las``): one session
that floods the queue cannot starve the others. Replayed in virtual time through the router's own
queue and pipeline."""

from __future__ import annotations

import statistics

from kvmesh.replay.config import ReplayConfig
from kvmesh.replay.mooncake_trace import TraceRequest
from kvmesh.replay.simulator import ReplaySimulator

SMALL = {"block_size": 16, "trace_block_size": 32, "num_blocks": 4096, "max_num_batched_tokens": 1024}
QUEUED = {**SMALL, "workers": 2, "active_prefill_tokens_threshold": 256, "router_queue_size": 4096}


def flood_and_others() -> list[TraceRequest]:
    """An agent fans out 40 requests at once; 12 other sessions send one each a moment later."""
    flood = [TraceRequest(0.0, 256, 8, tuple(range(10_000 + i * 8, 10_008 + i * 8)), "agent") for i in range(40)]
    others = [TraceRequest(5.0 + i, 256, 8, tuple(range(i * 8, i * 8 + 8)), f"chat-{i}") for i in range(12)]
    return flood + others


def waits(policy: str) -> tuple[float, float]:
    """(the other sessions' median wait, the agent's) in the router queue, in ms."""
    records = ReplaySimulator(ReplayConfig(**QUEUED, router_queue_policy=policy)).run(flood_and_others())
    assert all(r.tokens == r.output_length and not r.refused for r in records)
    agent = [r.queued_ms for r in records[:40]]
    others = [r.queued_ms for r in records[40:]]
    return statistics.median(others), statistics.median(agent)


def test_least_attained_service_lets_other_sessions_past_a_flooding_one():
    fcfs_others, _ = waits("fcfs")
    las_others, las_agent = waits("las")
    # first come: the others wait behind the whole flood; las serves each of them before the agent's
    # next request, once the agent has been served more than they have
    assert las_others < fcfs_others / 4, (las_others, fcfs_others)
    assert las_agent > las_others
