"""Every routing option ``kvmesh replay`` accepts changes a routing decision there, on a case built
for it, and every option it cannot model is refused with a line saying why. The replay runs the
router's own pipeline, so an option that took effect in the service and not here would make the
replay's figures a claim about another router. A routing option added without a case here fails
the first test."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvmesh.common.runtime.config import ConfigError
from kvmesh.replay.config import REFUSED_OPTIONS, ReplayConfig
from kvmesh.replay.mooncake_trace import TraceRequest
from kvmesh.replay.report import summarise
from kvmesh.replay.session_trace import SessionRules, generate
from kvmesh.replay.simulator import ReplaySimulator
from kvmesh.router.config import RoutingOptions

# small engines and blocks: every case replays in milliseconds
SMALL = {"block_size": 16, "trace_block_size": 32, "num_blocks": 4096, "max_num_batched_tokens": 1024}


def groups_trace(
    requests: int,
    groups: int,
    gap_ms: float,
    shared: int = 6,
    unique: int = 2,
    output: int = 8,
    sessions: bool = False,
) -> list[TraceRequest]:
    """``requests`` requests in ``groups`` prefix groups (``shared`` trace blocks in common, then
    ``unique`` of their own), one every ``gap_ms``; with ``sessions``, each names a session of its own."""
    trace = []
    for i in range(requests):
        group = i % groups
        prefix = tuple(range(group * 1000, group * 1000 + shared))
        own = tuple(range(100_000 + i * unique, 100_000 + (i + 1) * unique))
        session = f"s{i}" if sessions else None
        trace.append(TraceRequest(i * gap_ms, (shared + unique) * 32, output, prefix + own, session))
    return trace


def siblings_trace(requests: int = 64, groups: int = 16, siblings: int = 4, shared: int = 30) -> list[TraceRequest]:
    """Bursts of ``siblings`` requests 1 ms apart sharing a ``shared``-block prefix, every 50 ms:
    the later siblings arrive before the first's KV events can reach the index."""
    trace = []
    for i in range(requests):
        group = (i // siblings) % groups
        prefix = tuple(range(group * 1000, group * 1000 + shared))
        at = (i // siblings) * 50.0 + (i % siblings) * 1.0
        trace.append(TraceRequest(at, (shared + 2) * 32, 8, (*prefix, 100_000 + 2 * i, 100_001 + 2 * i)))
    return trace


def partial_matches_trace() -> list[TraceRequest]:
    """Pairs whose second request shares 2 of its first 5 trace blocks: 40% of its prompt is cached
    where the first went, between cache-aware's default threshold (30%) and 50%."""
    trace = []
    for i in range(24):
        base = i * 100
        first = tuple(range(base, base + 5))
        second = (base, base + 1, *range(base + 50, base + 53))
        trace.append(TraceRequest(i * 400.0, 160, 4, first))
        trace.append(TraceRequest(i * 400.0 + 200, 160, 4, second))
    return trace


def sessions_trace() -> list[TraceRequest]:
    """Chat sessions (kvmesh.replay.session_trace) shrunk to this file's small blocks and engines:
    their growing prefixes are evicted between turns, so only the session remembers their worker."""
    rows = generate("chat", SessionRules(sessions=40, seed=1, max_context_blocks=16))
    return [
        TraceRequest(
            r["timestamp"] / 20,
            r["input_length"] // 16,
            min(r["output_length"], 64),
            tuple(r["hash_ids"]),
            r["session_id"],
        )
        for r in rows
    ]


def parked_sessions_trace(sessions: int = 24, gap_ms: float = 300.0, think_ms: float = 5000.0) -> list[TraceRequest]:
    """A new session every ``gap_ms``, each sharing one trace block of system prompt and then its own 3,
    and its second turn ``think_ms`` later: a first turn finds the fleet idle, the sessions before it
    parked, and the system prompt's holder cheapest by that one block."""
    trace = []
    for i in range(sessions):
        own = (90_000, *range(1000 * i, 1000 * i + 3))
        trace.append(TraceRequest(i * gap_ms, len(own) * 32, 8, own, f"s{i}"))
        more = (*own, 1000 * i + 500, 1000 * i + 501)
        trace.append(TraceRequest(i * gap_ms + think_ms, len(more) * 32, 8, more, f"s{i}"))
    return sorted(trace, key=lambda request: request.timestamp_ms)


def behind_worker_trace() -> list[TraceRequest]:
    """A loaded fleet's 160 anonymous requests, then from 5 s a new session every 0.5 s (one turn each,
    4 blocks of its own): with one worker 20x slower than the router predicts (:data:`BEHIND`), every
    request that ends there has missed the ITL target by the time the sessions come."""
    trace = groups_trace(160, 8, 4.0)
    for i in range(30):
        blocks = tuple(range(500_000 + 4 * i, 500_004 + 4 * i))
        trace.append(TraceRequest(5000.0 + i * 500.0, 4 * 32, 8, blocks, f"s{i}"))
    return trace


BEHIND = {"workers": 4, "slow_workers": 1, "slow_worker_factor": 20.0, "router_timing": "prior"}


@dataclass
class Case:
    """A replay (its options and trace) whose decisions the option's ``changed`` value changes."""

    changed: Any
    trace: Callable[[], list[TraceRequest]]
    base: dict[str, Any] = field(default_factory=dict)


PD = {"workers": 2, "prefill_workers": 2, "disagg_min_uncached_tokens": 0}
# a fleet of 4 under load, 8 prefix groups arriving faster than it serves them
LOADED = lambda: groups_trace(160, 8, 4.0)  # noqa: E731
CACHE_AWARE = {"router_mode": "cache-aware", "workers": 4}
QUEUED = {"workers": 2, "active_prefill_tokens_threshold": 256}
# a device cache that holds one request: earlier prefixes live on in each worker's host tier
HOST_TIER = {"num_blocks": 32, "host_kv_blocks": 4096, "workers": 2}

CASES: dict[str, Case] = {
    "router_mode": Case("round-robin", LOADED, {"workers": 4}),
    "prefill_policy": Case("round-robin", LOADED, {**PD, "disagg_split_when": "always"}),
    "decode_policy": Case("round-robin", LOADED, {**PD, "disagg_split_when": "always"}),
    "cache_threshold": Case(0.5, partial_matches_trace, CACHE_AWARE),
    "balance_abs_threshold": Case(0, lambda: groups_trace(160, 2, 2.0), {**CACHE_AWARE, "balance_rel_threshold": 1.0}),
    "balance_rel_threshold": Case(1.0, lambda: groups_trace(160, 2, 2.0), {**CACHE_AWARE, "balance_abs_threshold": 0}),
    "eviction_interval_secs": Case(0.05, lambda: groups_trace(80, 8, 50.0), {**CACHE_AWARE, "max_tree_size": 64}),
    "max_tree_size": Case(64, lambda: groups_trace(80, 8, 50.0), {**CACHE_AWARE, "eviction_interval_secs": 0.05}),
    "cache_miss_policy": Case("least-loaded", lambda: groups_trace(80, 80, 5.0), CACHE_AWARE),
    # under plain kv: the default duplicate penalty outweighs the cost's terms on this trace
    "kv_cost": Case("blocks", LOADED, {"workers": 4, "kv_duplicate_penalty": 0.0}),
    "kv_overlap_score_weight": Case(0.0, LOADED, {"workers": 4, "kv_duplicate_penalty": 0.0}),
    "router_temperature": Case(5.0, LOADED, {"workers": 4}),
    "kv_duplicate_penalty": Case(0.0, LOADED, {"workers": 4}),
    "host_block_credit": Case(0.0, lambda: groups_trace(60, 6, 500.0, shared=8), HOST_TIER),
    # plain kv: the default penalty's count of prefixes in flight stands in for the prediction
    "router_predicted_ttl_secs": Case(0.0, siblings_trace, {"workers": 4, "kv_duplicate_penalty": 0.0}),
    # without decision 59's spread, which on this trace already places the writes that the active blocks move
    "track_active_blocks": Case(False, LOADED, {"workers": 4, "kv_write_spread": 0.0}),
    "kv_write_spread": Case(0.0, LOADED, {"workers": 4}),
    # one prefix group, each request a session of its own: its holder saturates, past the default
    # 1.5 times the others' mean, and its prefix is pulled to them
    "kv_pull_ratio": Case(0.0, lambda: groups_trace(160, 1, 4.0, sessions=True), {"workers": 4}),
    # a worker 20x slower than the router predicts falls behind it
    "kv_stall_slack": Case(
        0.0,
        lambda: groups_trace(160, 2, 20.0),
        {"workers": 4, "slow_workers": 1, "slow_worker_factor": 20.0, "router_timing": "prior"},
    ),
    # one prefix group: kv piles it onto few workers until their predicted load (outputs included) tells
    "router_track_output_blocks": Case(
        True, lambda: groups_trace(160, 1, 4.0, output=400), {"workers": 4, "kv_cost": "blocks"}
    ),
    "disagg_min_uncached_tokens": Case(10_000, LOADED, {**PD, "disagg_split_when": "always"}),
    "disagg_split_when": Case("always", LOADED, {**PD}),
    "disagg_split_overhead_ms": Case(10_000.0, LOADED, {**PD}),
    "prefill_queue_limit_tokens": Case(512, LOADED, {**PD, "disagg_split_when": "always"}),
    "active_decode_blocks_threshold": Case(40, LOADED, {"workers": 2}),
    "active_prefill_tokens_threshold": Case(256, LOADED, {"workers": 2}),
    "router_queue_size": Case(2, LOADED, QUEUED),
    "router_queue_timeout_secs": Case(0.05, LOADED, QUEUED),
    "router_queue_policy": Case("spf", lambda: groups_trace(160, 8, 4.0, unique=5), QUEUED),
    "session_affinity_ttl_secs": Case(
        0.0, sessions_trace, {"workers": 4, "num_blocks": 128, "session_block_credit": 0.5}
    ),
    "session_block_credit": Case(0.5, sessions_trace, {"workers": 4, "num_blocks": 128}),
    # a worker 20x slower than the router predicts decodes past the ITL target: new sessions start elsewhere
    "kv_itl_target_ms": Case(0.0, lambda: behind_worker_trace(), BEHIND),
    "session_loop_secs": Case(0.0, sessions_trace, {"workers": 4, "num_blocks": 128, "kv_duplicate_penalty": 4.0}),
    # without the spread every new session joins the system prompt's holder, where the others are parked
    "session_spread_ms": Case(0.0, parked_sessions_trace, {"workers": 4}),
    "router_queue_shares": Case(
        "high=1,normal=1,low=1", LOADED, {**QUEUED, "priority_mix": "high=0.2,normal=0.5,low=0.3"}
    ),
}


def routing_options() -> list[str]:
    return [f.name for f in dataclasses.fields(RoutingOptions)]


def decisions(config: ReplayConfig, trace: list[TraceRequest]) -> list[tuple]:
    """Where each request went and how: its worker, its prefill worker and KV source, whether and
    how long it waited in the router queue."""
    records = ReplaySimulator(config).run(trace)
    return [(r.worker, r.prefill_worker, r.kv_source, r.refused, round(r.queued_ms, 3)) for r in records]


def test_every_routing_option_has_a_case_or_a_refusal():
    assert set(CASES) | set(REFUSED_OPTIONS) == set(routing_options())
    assert not set(CASES) & set(REFUSED_OPTIONS)


@pytest.mark.parametrize("option", sorted(CASES))
def test_the_option_changes_a_decision_in_the_replay(option):
    case = CASES[option]
    base = ReplayConfig(**{**SMALL, **case.base})
    assert getattr(base, option) != case.changed, "the case must change the option"
    changed = dataclasses.replace(base, **{option: case.changed})
    for config in (base, changed):
        config.validate()
    trace = case.trace()
    assert decisions(base, trace) != decisions(changed, trace)


@pytest.mark.parametrize("option", sorted(REFUSED_OPTIONS))
def test_an_option_the_replay_cannot_model_is_refused_saying_why(option):
    default = next(f.default for f in dataclasses.fields(RoutingOptions) if f.name == option)
    ReplayConfig(**SMALL).validate()  # at its default it is accepted: it changes nothing
    with pytest.raises(ConfigError) as refused:
        ReplayConfig(**SMALL, **{option: default / 2 if isinstance(default, float) else default + 1}).validate()
    assert f"--{option.replace('_', '-')} has no effect in a replay" in str(refused.value)
    assert REFUSED_OPTIONS[option] in str(refused.value)


def test_loop_turns_are_spared_where_requests_name_no_session():
    """The same chats, their sessions unnamed: the router tells a loop's turn by its prompt, which
    extends one it routed moments before, and spares it the penalty as it spares a named session's."""
    anonymous = [dataclasses.replace(r, session=None) for r in sessions_trace()]
    base = ReplayConfig(**{**SMALL, "workers": 4, "num_blocks": 128, "kv_duplicate_penalty": 4.0})
    never_spared = dataclasses.replace(base, session_loop_secs=0.0)
    assert decisions(base, anonymous) != decisions(never_spared, anonymous)


def test_new_sessions_start_off_a_worker_whose_decodes_are_behind():
    """Worker 0 decodes 20 times slower than the router predicts: each request ending there missed the
    ITL target while the others kept it, so no new session starts there; without the target (0) the
    prediction alone sends it some (decision 67)."""
    trace = behind_worker_trace()

    def sessions_on_the_slow_worker(config: ReplayConfig) -> tuple[int, dict[str, int]]:
        records = ReplaySimulator(config).run(trace)
        return sum(1 for r in records if r.session and r.worker == 0), summarise(records).get("steered", {})

    kept = ReplayConfig(**{**SMALL, **BEHIND})
    assert kept.kv_itl_target_ms == 50.0  # the default
    on_slow, steered = sessions_on_the_slow_worker(kept)
    assert on_slow == 0
    assert steered.get("decodes behind", 0) > 0  # the summary says the rule moved them
    on_slow, steered = sessions_on_the_slow_worker(dataclasses.replace(kept, kv_itl_target_ms=0.0))
    assert on_slow > 0
    assert "decodes behind" not in steered


def test_new_sessions_spread_over_an_idle_fleet_not_onto_the_prompts_holder():
    """Decision 72: between turns a session runs nothing, so its worker looks idle to the cost; a new
    session then goes where the system prompt is cached, however many sessions are parked there."""
    trace = parked_sessions_trace()
    first: dict[str | None, int] = {}
    for i, request in enumerate(trace):
        first.setdefault(request.session, i)
    first_turns = set(first.values())

    def workers_of_first_turns(spread_ms: float) -> set[int]:
        config = ReplayConfig(**SMALL, workers=4, session_spread_ms=spread_ms)
        config.validate()
        records = ReplaySimulator(config).run(trace)
        return {record.worker for record in records if record.index in first_turns}

    assert len(workers_of_first_turns(0.0)) == 1
    assert len(workers_of_first_turns(ReplayConfig().session_spread_ms)) == 4
