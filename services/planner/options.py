"""The planner's options: what it aims for (the SLA) and how it decides; shared by ``kvmesh planner
run``, ``kvmesh up --planner`` and ``kvmesh replay --planner``, each validated alike."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.common.runtime.config import ConfigError, option
from kvmesh.planner.predictors import PREDICTORS

SIZINGS = ("queue", "dynamo")
UTILISATION_CAP_BOUNDS = (0.1, 0.9)


@dataclass
class PlannerOptions:
    """Planner: what it aims for (the SLA) and how it decides.

    Shared by ``kvmesh planner run``, ``kvmesh up --planner`` and ``kvmesh replay --planner``."""

    ttft_target_ms: float = option(2000.0, "TTFT each request should meet (ms)")
    itl_target_ms: float = option(50.0, "mean inter-token latency each request should meet (ms)")
    min_workers: int = option(1, "never fewer workers than this in a pool")
    max_workers: int = option(16, "never more workers than this in a pool")
    max_prefill_workers: int = option(0, "never more prefill workers than this (0: --max-workers)")
    load_predictor: str = option(
        "holt-winters",
        "how the next interval's load is predicted (holt-winters: a damped trend, which foresees a rise and a "
        "fall that a constant lags; docs/decisions/0052)",
        choices=PREDICTORS,
    )
    predictor_window: int = option(3, "intervals the moving average (and Holt-Winters' fallback) looks back")
    season_length: int = option(0, "Holt-Winters: intervals per season (0: trend only)")
    scale_down_intervals: int = option(2, "intervals in a row that must ask for fewer workers before a pool shrinks")
    adjustment_interval: float = option(60.0, "seconds between decisions")
    worker_startup_secs: float = option(
        30.0,
        "seconds from starting a worker to its first request, until the planner has measured it (the slowest of "
        "its last 3 growths, from asking to the workers serving): it sizes for the load then",
    )
    growth_look_secs: float = option(
        5.0,
        "seconds between looks at the interval so far: while the SLA's window has no misses to spare, a pool whose "
        "finished requests are clearly behind the attainment goal (beyond chance) grows then, to what the model "
        "asks for at the load seen, instead of at the interval's end (0: no looks; docs/decisions/0065)",
    )
    ttft_headroom: float = option(
        0.5, "plan for this share of --ttft-target-ms, leaving the rest for requests above the mean"
    )
    itl_headroom: float = option(0.8, "plan for this share of --itl-target-ms")
    attainment_goal: float = option(
        0.95,
        "share of requests that should meet both targets; an interval below it grows the pool at fault (while "
        "the SLA's window has misses to spare, only one below it beyond chance: docs/decisions/0066)",
    )
    attainment_window: float = option(
        3600.0,
        "seconds over which the goal is kept (the SLA's window): pools shrink only while the requests "
        "finished in it met the goal with room to spare, or the pool, its load as forecast, now misses almost "
        "nothing (docs/decisions/0068)",
    )
    utilisation_cap: float = option(
        0.5, "starting cap on a worker's planned prefill utilisation (then learned from the attainment)"
    )
    idle_shrink_utilisation: float = option(
        0.2,
        "a pool may shrink while the SLA's window has no misses to spare if the model plans one worker fewer at "
        "most this busy for the forecast load, and shrinks at once (by half at most) to a size it plans this idle "
        "(0: never): a shrink so far from capacity risks no miss (docs/decisions/0052, 0053; aggregated pools)",
    )
    shrink_margin: float = option(
        0.65,
        "a pool shrinks only to a size planned within this share of the utilisation cap (1: no deadband); "
        "it grows at the cap itself",
    )
    sizing: str = option(
        "queue",
        "how pools are sized: queue (kvmesh's queueing model, learned cap) or dynamo (NVIDIA Dynamo's "
        "throughput-per-worker interpolation with its correction factors, for comparison)",
        choices=SIZINGS,
    )

    @property
    def prefill_ceiling(self) -> int:
        """The most prefill workers: ``--max-prefill-workers``, else ``--max-workers``."""
        return self.max_prefill_workers or self.max_workers

    def validate(self) -> None:
        if self.ttft_target_ms <= 0 or self.itl_target_ms <= 0:
            raise ConfigError("--ttft-target-ms and --itl-target-ms must be positive")
        if not 0 <= self.min_workers <= self.max_workers or self.max_workers <= 0:
            raise ConfigError("need 0 <= --min-workers <= --max-workers and --max-workers > 0")
        if self.max_prefill_workers and self.max_prefill_workers < max(self.min_workers, 1):
            raise ConfigError("--max-prefill-workers must be 0 (--max-workers) or at least --min-workers and 1")
        if self.adjustment_interval <= 0 or self.worker_startup_secs < 0:
            raise ConfigError("--adjustment-interval must be positive and --worker-startup-secs >= 0")
        if self.growth_look_secs < 0:
            raise ConfigError("--growth-look-secs must be 0 (no looks) or positive")
        if self.predictor_window <= 0 or self.scale_down_intervals <= 0 or self.season_length < 0:
            raise ConfigError("--predictor-window and --scale-down-intervals must be positive")
        if not (0 < self.ttft_headroom <= 1 and 0 < self.itl_headroom <= 1):
            raise ConfigError("--ttft-headroom and --itl-headroom must be in (0, 1]")
        if not 0 < self.attainment_goal <= 1:
            raise ConfigError("--attainment-goal must be in (0, 1]")
        if self.attainment_window <= 0:
            raise ConfigError("--attainment-window must be positive (seconds)")
        low, high = UTILISATION_CAP_BOUNDS
        if not low <= self.utilisation_cap <= high:
            raise ConfigError(f"--utilisation-cap must be in [{low}, {high}]")
        if not 0 <= self.idle_shrink_utilisation < 1:
            raise ConfigError("--idle-shrink-utilisation must be in [0, 1)")
        if not 0 < self.shrink_margin <= 1:
            raise ConfigError("--shrink-margin must be in (0, 1]")
