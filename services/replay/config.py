"""``kvmesh replay``'s configuration (one typed object, the router's and the planner's options
included) and the record it keeps of each replayed request."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from kvmesh.common.runtime.config import ConfigError, option
from kvmesh.common.wire.frontend_load import RequestSample
from kvmesh.common.wire.priority import parse_mix
from kvmesh.planner.options import PlannerOptions
from kvmesh.replay.arrival_profile import parse_arrival_profile
from kvmesh.router.config import RouterConfig, RoutingOptions
from kvmesh.router.policy import POLICY_MODES
from kvmesh.worker.config import CacheMoveOptions

# the modes a replay can simulate (``direct`` needs a caller that names the worker)
REPLAY_MODES = POLICY_MODES


# The router's options a replay cannot model, and why: each is refused when set (at its default it
# changes nothing). Every other routing option takes effect in the replay as in the router
# (tests/replay/test_replay_routing_options.py shows each one change a decision).
REFUSED_OPTIONS = {
    "lora_load_tokens": "a Mooncake trace names no LoRA adapter, so no worker ever loads one",
    "pooled_block_credit": "the replay's workers share no KV pool",
    "disk_block_credit": "the replay's workers have no disk tier (--host-kv-blocks gives them a host tier)",
    "moe_score_weight": "a Mooncake trace carries no MoE query",
    "kv_pull_ms_per_token": "a replay's pulls take the KV transfer's time (--kv-bytes-per-token, --kv-transfer-gbps)",
}


# A step's KV events reach a live mesh's index this long after the step ends: 5.4 ms median (6.3 ms
# p90) from the client's answer to the indexer's match, plus about 1 ms for the answer to travel
# (kvmesh up, 2 mock workers, 2026-11-26; docs/perf/README.md, "KV event delay").
DEFAULT_KV_EVENT_DELAY_MS = 6.5


TOO_LONG = "too_long"


@dataclass
class ReplayConfig(RoutingOptions, PlannerOptions, CacheMoveOptions):
    """The simulated fleet and trace handling; the routing options are the router's own, the SLA
    targets and scaling options the planner's."""

    workers: int = option(8, "simulated workers (decode workers when --prefill-workers is set)")
    block_size: int = option(64, "tokens per KV block")
    num_blocks: int = option(16384, "KV blocks per worker", flag="--num-gpu-blocks-override")
    max_num_seqs: int = option(256, "running sequences per worker")
    max_num_batched_tokens: int = option(8192, "token budget of one engine step")
    arrival_speedup_ratio: float = option(1.0, "divide trace timestamps by this (higher = heavier load)")
    trace_block_size: int = option(512, "tokens each trace hash id stands for")
    seed: int = option(0, "seed of tie-breaking and sampling")
    prefill_workers: int = option(
        0, "prefill workers besides --workers (which then decode); 0: every worker is aggregated"
    )
    # KV bytes per token of the modelled model (Llama-3-8B in bf16: 32 layers × 8 KV heads × 128 × 2 × 2)
    kv_bytes_per_token: int = option(131072, "KV bytes per token of the modelled model (transfer size)")
    # KV transfer bandwidth, GB/s (25: a 200 Gb/s RDMA link)
    kv_transfer_gbps: float = option(25.0, "KV transfer bandwidth, GB/s")
    slow_workers: int = option(
        0, "the first N workers' engines are --slow-worker-factor times slower (heterogeneous fleet)"
    )
    slow_worker_factor: float = option(2.0, "how much slower the slow workers' steps are")
    router_timing: str = option(
        "exact",
        "what the router's ttft cost knows of each worker's step times: exact (its true model), prior (the "
        "nominal model scaled by --router-prefill-scale / --router-decode-scale, for every worker), or learned "
        "(fitted from the steps each worker runs, starting from that prior, and pooled as the live router pools "
        "what its workers advertise: one shape, each worker at its own speed)",
        choices=("exact", "prior", "learned"),
    )
    router_prefill_scale: float = option(1.0, "the prior's prefill times are the nominal ones times this")
    router_decode_scale: float = option(1.0, "the prior's decode times are the nominal ones times this")
    timing_refit_steps: int = option(50, "with --learn-timing: steps between refits of a worker's model")
    arrival_profile: str = option(
        "",
        "reshape the arrival rate over time: sine:period=S,amplitude=A[,phase=S] or step:at=S,factor=F (seconds)",
    )
    host_kv_blocks: int = option(
        0,
        "each worker's host tier: evicted blocks go there and are reloaded for a later request (their events are "
        "indexed as the worker's host tier and credited at --host-block-credit; 0: none)",
    )
    kv_event_delay_ms: float = option(
        DEFAULT_KV_EVENT_DELAY_MS,
        "time from a step's end until its KV events are in the index the router asks (measured on a live mesh of "
        "mock workers: 5 ms of event batching, then NATS and the indexer; docs/perf); 0: at once",
    )
    oracle_index: bool = option(
        False,
        "route on what every worker holds or is computing at the instant of routing, as no event-fed index can: "
        "the bound predict-on-route aims at (ignores --kv-event-delay-ms and --router-predicted-ttl-secs)",
    )
    cache_replies: bool = option(
        False,
        "in a session trace, cache each turn's reply on the worker that served it when the turn ends, as a real "
        "worker keeps the KV it decodes, so the session's next turn finds it there (decision 75)",
    )
    priority_mix: str = option(
        "",
        "with the router queue (--active-*-threshold): each request's priority class, drawn with --seed from these "
        "shares, e.g. high=0.2,normal=0.5,low=0.3 (default: every request normal)",
    )
    worker_join_secs: float = option(
        -1.0,
        "with --planner: seconds a started virtual worker takes to serve (-1: --worker-startup-secs); another "
        "value makes --worker-startup-secs only the planner's first guess, which it corrects by measuring",
    )
    planner: bool = option(
        False,
        "scale the fleet with the planner (virtual connector): --workers (and --prefill-workers, whose prefill and "
        "decode pools it then sizes apart) are the starting sizes",
    )

    def kv_transfer_ms(self, blocks: int) -> float:
        """How long the modelled KV transfer takes to move ``blocks`` blocks (a remote prefill's, a
        shrink's handoff, a join's warm-up)."""
        return blocks * self.block_size * self.kv_bytes_per_token / (self.kv_transfer_gbps * 1e6)

    def join_secs(self) -> float:
        """How long a started virtual worker takes to serve."""
        return self.worker_startup_secs if self.worker_join_secs < 0 else self.worker_join_secs

    def validate(self) -> None:
        RoutingOptions.validate(self)
        PlannerOptions.validate(self)
        defaults = {f.name: f.default for f in dataclasses.fields(RoutingOptions)}
        for name, why in REFUSED_OPTIONS.items():
            if getattr(self, name) != defaults[name]:
                raise ConfigError(f"--{name.replace('_', '-')} has no effect in a replay: {why}")
        parse_arrival_profile(self.arrival_profile)
        if self.router_mode not in REPLAY_MODES:
            raise ConfigError(f"--router-mode must be one of {', '.join(REPLAY_MODES)} in a replay")
        for name in ("workers", "block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive")
        self.check_cache_moves()
        if self.trace_block_size <= 0 or self.arrival_speedup_ratio <= 0:
            raise ConfigError("--trace-block-size and --arrival-speedup-ratio must be positive")
        if self.priority_mix:
            try:
                parse_mix(self.priority_mix)
            except ValueError as exc:
                raise ConfigError(f"--priority-mix: {exc}") from None
        if self.host_kv_blocks < 0:
            raise ConfigError("--host-kv-blocks must be >= 0")
        if self.kv_event_delay_ms < 0:
            raise ConfigError("--kv-event-delay-ms must be >= 0")
        if self.prefill_workers < 0:
            raise ConfigError("--prefill-workers must be >= 0")
        if self.kv_bytes_per_token <= 0 or self.kv_transfer_gbps <= 0:
            raise ConfigError("--kv-bytes-per-token and --kv-transfer-gbps must be positive")
        if min(self.router_prefill_scale, self.router_decode_scale, self.slow_worker_factor) <= 0:
            raise ConfigError("--router-prefill-scale, --router-decode-scale and --slow-worker-factor must be positive")
        if self.timing_refit_steps <= 0 or not 0 <= self.slow_workers <= self.workers:
            raise ConfigError("--timing-refit-steps must be positive and --slow-workers at most --workers")


@dataclass
class RequestRecord:
    """What happened to one trace request, in simulated milliseconds."""

    index: int
    arrival_ms: float
    input_length: int
    output_length: int
    worker: int = -1  # its (decode) worker
    prefill_worker: int = -1  # with prefill workers: the one that prefilled it remotely (-1: none)
    cached_tokens: int = 0
    first_token_ms: float = math.nan
    last_token_ms: float = math.nan
    tokens: int = 0
    inter_token_ms: list[float] = field(default_factory=list)
    # with prefill workers: where the KV came from ("remote", or the local reason)
    kv_source: str = ""
    session: str = ""  # the session it belongs to (a session-structured trace's)
    steered_by: str = ""  # the rule that moved it off the worker its cost rated cheapest (Decision.steered_by)
    pulled_tokens: int = 0  # prompt tokens its worker pulled from another before computing the rest
    priority: str = "normal"  # its class at the router queue
    queued_ms: float = 0.0  # time it waited in the router queue
    # why it was refused: the router queue's "full", "timeout" or "busy", or TOO_LONG (no worker can
    # hold its prompt and output); empty: served
    refused: str = ""

    @property
    def ttft_ms(self) -> float:
        return self.first_token_ms - self.arrival_ms

    @property
    def e2e_ms(self) -> float:
        return self.last_token_ms - self.arrival_ms

    @property
    def tpot_ms(self) -> float:
        return (self.last_token_ms - self.first_token_ms) / (self.tokens - 1) if self.tokens > 1 else math.nan

    def sample(self) -> RequestSample:
        """This request as a frontend would report it to the planner."""
        return RequestSample(self.input_length, self.tokens, self.cached_tokens, self.ttft_ms, self.tpot_ms)


def router_config(config: ReplayConfig) -> RouterConfig:
    """The router configuration a replay routes with: its routing options, a live router's defaults
    for the rest (KV events on, approximate mode off, no disaggregation enforced)."""
    options = {f.name: getattr(config, f.name) for f in dataclasses.fields(RoutingOptions)}
    # the router prices a pull at what the replay's transfer takes (kv_transfer_ms, per token)
    options["kv_pull_ms_per_token"] = config.kv_bytes_per_token / (config.kv_transfer_gbps * 1e6)
    return RouterConfig(**options)
