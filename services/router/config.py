"""Router options, each declared once and shared by every command that takes it.

- :class:`RoutingOptions`: how a worker is chosen for a request (mode, cost, weights,
  disaggregation thresholds, busy thresholds and the router queue). The router service,
  ``kvmesh up`` and ``kvmesh replay`` take these.
- :class:`RouterOptions`: the rest of what a router replica needs (KV events or approximate mode,
  replica sync, migration, disaggregation orchestration). The router service and
  ``kvmesh up`` take these; ``kvmesh up`` hands them to its routers with :func:`options_argv`.
- :class:`RouterConfig`: the router service's whole configuration.

Validation is declared with the options it checks, so every command validates alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.common.core.tier_credits import TierCredits
from kvmesh.common.runtime.config import ConfigError, GrpcEndpointConfig, option
from kvmesh.common.wire.priority import parse_shares
from kvmesh.router.cache_aware import MISS_POLICIES, CacheAwareOptions
from kvmesh.router.policy import POLICY_MODES, STALL_FLOOR_S
from kvmesh.router.request_queue import DEFAULT_SHARES, QUEUE_POLICIES, QueueConfig
from kvmesh.router.scheduler import COST_MODELS

ROUTER_MODES = (*POLICY_MODES, "direct")
_SGLANG = CacheAwareOptions()  # cache-aware mode's defaults are sglang-router 0.3.2's


@dataclass
class KvModeOptions:
    """Routing, kv mode: the cost of a worker's cached overlap against its predicted load."""

    kv_cost: str = option(
        "ttft", "KV cost model: predicted time to first token, or Dynamo's block formula", choices=COST_MODELS
    )
    kv_overlap_score_weight: float = option(1.0, "weight of prefill work in the KV cost (0: load only)")
    router_temperature: float = option(0.0, "softmax temperature over normalised costs (0: pick the minimum)")
    kv_duplicate_penalty: float = option(
        128.0,
        "kv mode: the cost of copying a prefix a candidate already holds: each such block another worker would "
        "recompute counts this many extra blocks of its prefill, a prefix a request in flight there has counts as "
        "held, and a loop's next turn (--session-loop-secs) is not charged, nor anything while the candidates' "
        "requests in flight are imbalanced by --balance-abs-threshold and --balance-rel-threshold "
        "(docs/decisions/0056), nor a prompt no candidate holds more than --cache-threshold of (a mostly new "
        "prompt goes where it is computed soonest, docs/decisions/0058). The default holds a prefix on its holder "
        "unless the holder's queue is far longer: "
        "cache-aware's reuse with kv's latency in every replayed trace (docs/decisions/0054). 0: plain kv, the cost "
        "of the request in hand alone",
    )
    kv_write_spread: float = option(
        0.75,
        "kv mode, with the duplicate penalty: a mostly new prompt (no candidate holds more than --cache-threshold "
        "of it) goes to the least-written worker among those written less than this share of the candidates' mean "
        "uncached tokens, holding as much of it and predicted within --balance-rel-threshold times the cheapest: "
        "every cache then turns over about as fast, as cache-aware's smallest-tree rule does (docs/decisions/0059); "
        "a worker that joins a fleet already written starts at the others' mean (docs/decisions/0060). "
        "0: off, placed by cost alone",
    )
    kv_stall_slack: float = option(
        2.0,
        "kv mode: a worker whose queued prefill has gone longer without progress (no first token, no request "
        f"ending there) than this many times the request's predicted cost there, plus {STALL_FLOOR_S:g} s, is "
        "behind its prediction: the excess is added to its cost and the duplicate penalty holds no prefix on it, "
        "so a stalled engine's sessions move (docs/decisions/0063). 0: off, the prediction trusted",
    )
    kv_itl_target_ms: float = option(
        50.0,
        "kv mode: the inter-token latency a worker's decodes should keep (a request's mean, as measured from its "
        "first token to its end). A session's first turn is charged 500 ms on a worker where more than 10%% of the "
        "requests ended in the last 20 s missed it, while another candidate's missed at most 2%%, and is not held "
        "there by the duplicate penalty: new sessions start where decodes keep pace, and no session already "
        "placed is moved (docs/decisions/0067). 0: off",
    )
    kv_pull_ratio: float = option(
        1.5,
        "kv mode: where the worker holding the longest cached prefix of a prompt is predicted to start it more than "
        "this many times later than the other candidates' mean, each is also costed as if it pulled that prefix "
        "from the holder over the KV transfer (at --kv-pull-ms-per-token) instead of computing it, and the request "
        "goes where it starts soonest: a saturated holder's prefix is copied, not recomputed and not piled on "
        "(docs/decisions/0070). Only for a request that names its session (whose context the pull moves with it; "
        "an anonymous shared prefix is not copied, docs/decisions/0071), and only between workers whose engines "
        "move cached blocks (the mock engine's; vLLM's workers never pull). 0: off",
    )
    kv_pull_ms_per_token: float = option(
        0.00524,
        "kv mode: the time the KV transfer takes to pull one token's KV from another worker (the default: 128 KiB a "
        "token at 25 GB/s; kvmesh replay sets it from its --kv-bytes-per-token and --kv-transfer-gbps)",
    )
    lora_load_tokens: int = option(
        1024,
        "kv mode: the prefill tokens loading a LoRA adapter is worth: a worker that serves the adapter a request "
        "names but does not hold it loaded now (see the worker's --max-loras) is charged them",
    )
    pooled_block_credit: float = option(
        0.9,
        "kv mode: a block a worker can import from its host's KV pool counts as this share of a block in its own "
        "cache (cheaper than recomputing, dearer than already there; 0: ignore the pool)",
    )
    host_block_credit: float = option(
        0.75,
        "kv mode: a block a worker holds offloaded in host memory counts as this share of one in its device memory "
        "(a reload is cheaper than recomputing; NVIDIA Dynamo's default)",
    )
    disk_block_credit: float = option(
        0.25, "kv mode: a block a worker holds offloaded on disk counts as this share of one in its device memory"
    )
    router_predicted_ttl_secs: float = option(
        2.0,
        "kv mode: at routing time the chosen worker is taken to cache the request's blocks for this long, until its "
        "KV events reach the indexers (siblings arriving together then meet their shared prefix; 0: off)",
    )
    moe_score_weight: float = option(
        0.5,
        "kv mode, MoE models: a request's moe_query waives this share of the cost of a worker whose cached blocks "
        "were computed with all the experts it names (in proportion for some; 0: ignore moe_query)",
    )
    track_active_blocks: bool = option(
        True, "count active KV blocks in the cost (--no-track-active-blocks: prefill only)"
    )
    router_track_output_blocks: bool = option(False, "grow a request's predicted blocks as its output grows")


@dataclass
class CacheAwareModeOptions:
    """Routing, cache-aware mode (SGLang's policy): a tree of what was sent where."""

    cache_threshold: float = option(
        _SGLANG.cache_threshold,
        "cache-aware: least matched fraction of the prompt that routes to its holder (kv: that its duplicate penalty "
        "holds there)",
    )
    balance_abs_threshold: int = option(
        _SGLANG.balance_abs_threshold,
        "cache-aware, and kv's duplicate penalty: loads are imbalanced when max - min requests in flight exceeds "
        "this (and the relative test)",
    )
    balance_rel_threshold: float = option(
        _SGLANG.balance_rel_threshold,
        "cache-aware: ... and max exceeds min times this; then the least loaded wins (kv: the penalty is waived)",
    )
    eviction_interval_secs: float = option(
        _SGLANG.eviction_interval_secs, "cache-aware: seconds between trims of each worker's share of the tree"
    )
    max_tree_size: int = option(_SGLANG.max_tree_size, "cache-aware: tokens each worker's share is trimmed to")
    cache_miss_policy: str = option(
        _SGLANG.miss_policy,
        "cache-aware: where a prompt the tree matches poorly goes: smallest-tree (SGLang's documented policy: the "
        "worker with the most cache to spare) or least-loaded (what sglang-router 0.3.2's code does: the fewest "
        "requests in flight)",
        choices=MISS_POLICIES,
    )


@dataclass
class SplitOptions:
    """Routing, prefill/decode split: when a request prefills on a prefill worker."""

    disagg_min_uncached_tokens: int = option(
        512, "prefill on the decode worker itself when it lacks fewer prompt tokens than this (0: always remote)"
    )
    disagg_split_when: str = option(
        "gain",
        "gain: split a request into a remote prefill and a decode only when the prefill worker's predicted time to "
        "first token plus the split's measured overhead beats what a local prefill costs: its first token plus the "
        "stall it puts on the requests decoding there (the ttft cost model; docs/decisions/0037, 0039); always: "
        "whenever the rules above allow it",
        choices=("gain", "always"),
    )
    disagg_split_overhead_ms: float = option(
        0.0, "what a split is taken to add to time to first token until the router has measured it"
    )
    prefill_queue_limit_tokens: int = option(
        65536, "a prefill worker with more predicted queued prefill tokens has no capacity for another prefill"
    )


@dataclass
class AdmissionOptions:
    """Routing, admission: the busy thresholds and the router queue behind them."""

    active_decode_blocks_threshold: int | None = option(
        None,
        "a worker with more active blocks is busy; when all are busy requests wait in the router queue (a routed "
        "request may still go to a busy worker where its cost is lowest: docs/decisions/0045)",
    )
    active_prefill_tokens_threshold: int | None = option(
        None,
        "a worker with more queued prefill tokens is busy; when all are busy requests wait in the router queue (as "
        "--active-decode-blocks-threshold)",
    )
    router_queue_size: int = option(
        256,
        "requests of each priority class a router holds while every worker is busy (0: no queue, refuse at once)",
    )
    router_queue_timeout_secs: float = option(
        30.0, "a request waiting in the router queue longer than this is refused (503 with Retry-After)"
    )
    router_queue_policy: str = option(
        "fcfs",
        "which waiting request of a class goes first: fcfs (first come), spf (shortest uncached prefill) or las "
        "(the session served least lately: its admitted prompt tokens, halving every minute, so that one long "
        "agent loop cannot starve the other sessions)",
        choices=QUEUE_POLICIES,
    )
    router_queue_shares: str = option(
        DEFAULT_SHARES,
        "the share of queue turns each priority class gets while several wait (a low class is slowed, never starved)",
    )


@dataclass
class SessionOptions:
    """Routing, sessions: a session's turns prefer the worker that served its last turn."""

    session_affinity_ttl_secs: float = option(
        600.0,
        "kv mode: how long after a session's last turn the router still prefers that turn's worker for its next "
        "(a request names its session: x-session-id and the agents' headers, the body's user or kvmesh.session, "
        "gRPC's routing.session_id); 0: sessions are not kept",
    )
    session_block_credit: float = option(
        0.0,
        "kv mode: the affinity's weight in the cost: the session's last worker is taken to hold this share of the "
        "blocks the new turn shares with the last one, where the indexers do not report them already (a preference, "
        "never a pin: a busier or departed worker is left). 0: sessions are kept, shared and shown, but the "
        "indexers' view alone decides (docs/decisions/0046: with exact KV events a credit helped only a fleet past "
        "its capacity)",
    )
    session_loop_secs: float = option(
        10.0,
        "kv mode, with --kv-duplicate-penalty: a turn that comes within this many seconds of its session's last "
        "turn, which came as soon after the one before (or that names no session and extends a prompt routed that "
        "recently, which extended one routed as recently), continues a loop (an agent's tool calls), and the penalty "
        "is not charged to it, so a loop's turns are not queued behind each other on a busy holder; one quick turn "
        "alone is as often a person's reply and is charged (0: every turn is charged; docs/decisions/0048, 0054, "
        "0064)",
    )
    session_spread_ms: float = option(
        5.0,
        "kv mode: a session's first turn is charged this many ms at a worker for each session parked there beyond "
        "the candidates' mean (a session whose last turn went there within the last minute): between turns a session "
        "runs nothing, so its worker looks idle, and when it comes back its decodes share that worker's steps "
        "(docs/decisions/0072); 0: off",
    )


@dataclass
class RoutingOptions(KvModeOptions, CacheAwareModeOptions, SplitOptions, AdmissionOptions, SessionOptions):
    """Routing: the mode a worker is chosen in (and with prefill workers, each pool's).

    Declared once with its sub-groups above, so the router, ``kvmesh up`` and ``kvmesh replay`` take
    and validate the same options."""

    router_mode: str = option(
        "kv",
        "how workers are chosen: kv (cached overlap against predicted load), round-robin, random, power-of-two (the "
        "less loaded of two random workers), cache-aware (SGLang's policy: a tree of what was sent where, no KV "
        "events), direct (the request names its worker)",
        choices=ROUTER_MODES,
    )
    prefill_policy: str | None = option(
        None, "with prefill workers: how the prefill worker is chosen (default: --router-mode)", choices=POLICY_MODES
    )
    decode_policy: str | None = option(
        None, "with prefill workers: how the decode worker is chosen (default: --router-mode)", choices=POLICY_MODES
    )

    def tier_credits(self) -> TierCredits:
        """``--pooled-block-credit``, ``--host-block-credit``, ``--disk-block-credit``."""
        return TierCredits(self.pooled_block_credit, self.host_block_credit, self.disk_block_credit)

    def cache_aware_options(self) -> CacheAwareOptions:
        return CacheAwareOptions(
            self.cache_threshold,
            self.balance_abs_threshold,
            self.balance_rel_threshold,
            self.eviction_interval_secs,
            self.max_tree_size,
            self.cache_miss_policy,
        )

    def validate(self) -> None:
        if not 0 <= self.cache_threshold <= 1:
            raise ConfigError("--cache-threshold must be between 0 and 1")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ConfigError("--balance-abs-threshold must be >= 0 and --balance-rel-threshold >= 1")
        if self.eviction_interval_secs <= 0 or self.max_tree_size <= 0:
            raise ConfigError("--eviction-interval-secs and --max-tree-size must be positive")
        if self.kv_overlap_score_weight < 0 or self.kv_duplicate_penalty < 0:
            raise ConfigError("--kv-overlap-score-weight and --kv-duplicate-penalty must be >= 0")
        if self.kv_stall_slack < 0:
            raise ConfigError("--kv-stall-slack must be >= 0")
        if self.kv_itl_target_ms < 0:
            raise ConfigError("--kv-itl-target-ms must be >= 0 (0: off)")
        if self.kv_pull_ratio < 0 or self.kv_pull_ms_per_token < 0:
            raise ConfigError("--kv-pull-ratio and --kv-pull-ms-per-token must be >= 0 (0: off)")
        if not 0 <= self.kv_write_spread <= 1:
            raise ConfigError("--kv-write-spread must be between 0 and 1")
        if self.lora_load_tokens < 0:
            raise ConfigError("--lora-load-tokens must be >= 0")
        for name in ("pooled_block_credit", "host_block_credit", "disk_block_credit"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be between 0 and 1")
        if self.router_predicted_ttl_secs < 0:
            raise ConfigError("--router-predicted-ttl-secs must be >= 0")
        if not 0 <= self.moe_score_weight < 1:
            raise ConfigError("--moe-score-weight must be in [0, 1)")
        if self.router_temperature < 0:
            raise ConfigError("--router-temperature must be >= 0")
        if self.disagg_split_overhead_ms < 0:
            raise ConfigError("--disagg-split-overhead-ms must be >= 0")
        if self.disagg_min_uncached_tokens < 0 or self.prefill_queue_limit_tokens <= 0:
            raise ConfigError("--disagg-min-uncached-tokens must be >= 0 and --prefill-queue-limit-tokens > 0")
        if self.session_affinity_ttl_secs < 0 or not 0 <= self.session_block_credit <= 1:
            raise ConfigError("--session-affinity-ttl-secs must be >= 0 and --session-block-credit in [0, 1]")
        if self.session_loop_secs < 0:
            raise ConfigError("--session-loop-secs must be >= 0")
        if self.session_spread_ms < 0:
            raise ConfigError("--session-spread-ms must be >= 0 (0: off)")
        if self.router_queue_size < 0 or self.router_queue_timeout_secs <= 0:
            raise ConfigError("--router-queue-size must be >= 0 and --router-queue-timeout-secs > 0")
        try:
            parse_shares(self.router_queue_shares)
        except ValueError as exc:
            raise ConfigError(f"--router-queue-shares: {exc}") from None

    def queue_config(self) -> QueueConfig:
        return QueueConfig(
            self.router_queue_size,
            self.router_queue_timeout_secs,
            self.router_queue_policy,
            parse_shares(self.router_queue_shares),
        )


@dataclass
class RouterOptions(RoutingOptions):
    """Router replicas: KV events or approximate mode, replica sync, migration, enforced splits.

    What a router takes besides its endpoint and the routing options."""

    kv_events: bool = option(
        True, "use the indexers' view built from KV events; --no-kv-events predicts caches from routing decisions"
    )
    router_ttl_secs: float = option(120.0, "approximate mode: seconds a routed block is assumed cached")
    router_max_tree_size: int = option(1 << 20, "approximate mode: most (worker, block) pairs remembered")
    indexer_timeout_ms: float = option(500.0, "deadline of one overlap query to an indexer replica")
    request_timeout_secs: float = option(600.0, "forget a routed request after this long (a lost free)")
    router_replica_sync: bool = option(False, "share routing decisions with the other router replicas over NATS")
    migration_limit: int = option(3, "times a request whose worker fails mid-stream moves to another worker")
    worker_avoid_secs: float = option(5.0, "seconds a worker that failed a stream is not chosen")
    enforce_disagg: bool = option(
        False, "every request must prefill on a prefill worker: no prefill pool or a failed prefill is an error"
    )

    def validate(self) -> None:
        super().validate()
        if self.router_ttl_secs <= 0 or self.router_max_tree_size <= 0:
            raise ConfigError("--router-ttl-secs and --router-max-tree-size must be positive")
        if self.request_timeout_secs <= 0 or self.indexer_timeout_ms <= 0:
            raise ConfigError("--request-timeout-secs and --indexer-timeout-ms must be positive")
        if self.migration_limit < 0 or self.worker_avoid_secs < 0:
            raise ConfigError("--migration-limit and --worker-avoid-secs must be >= 0")


@dataclass
class RouterConfig(GrpcEndpointConfig, RouterOptions):
    seed: int | None = option(None, "seed for tie-breaking and sampling (default: random)")
    load_report_secs: float = option(5.0, "seconds between the per-worker load reports published for the planner")

    def validate(self) -> None:
        RouterOptions.validate(self)
        if self.load_report_secs <= 0:
            raise ConfigError("--load-report-secs must be positive")
