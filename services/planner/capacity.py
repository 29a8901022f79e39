"""The performance model: TTFT and ITL that a pool of workers would give under a forecast load,
from a measured engine profile; and the smallest pools that meet the targets.

Aggregated worker (the router spreads load evenly; λw = λ / N requests/s per worker):
  P   = mean prefill work per request (ms): the profile's TTFT averaged over the prompt lengths,
        taken as gamma-distributed with the forecast's mean and cv² (prefill time is convex in the
        length, so the mean prompt's time would understate it); E[P²] likewise
  ρ   = λw · P / 1000                       share of engine time spent prefilling
  ITL = d(c) / (1 − ρ)                      a step carries decode d(c) plus its share of prefill;
  c   = λw · OSL · ITL / 1000               Little's law: sequences decoding at once (fixed point)
  TTFT = W + P + chunks · d(c),  W = C(N, ρ) · P · (1 + cv²) / (2 N (1 − ρ))
                                             M/G/N wait for the prefills queued ahead (the router sends a
                                             request to a free worker while one is); C is Erlang C, the
                                             chance all N are busy (ρ for one worker: Pollaczek-Khinchine);
                                             cv² of the prefill times is that of the prompt lengths

Prefill worker: the same without decode (TTFT = W + P). Decode worker: ITL = d(c), no prefill.
The model speaks of means; the planner corrects it with what it observes (see planner.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.common.core.engine_profile import EngineProfile
from kvmesh.planner.load import LoadForecast

MAX_UTILISATION = 0.95  # beyond this the queue model says "unbounded": never plan for it


@dataclass(frozen=True)
class Estimate:
    ttft_ms: float  # mean
    itl_ms: float
    utilisation: float
    ttft_attainment: float = 1.0  # predicted share of requests within the TTFT target asked about

    @property
    def stable(self) -> bool:
        return self.utilisation < MAX_UTILISATION


def _decode_fixed_point(profile: EngineProfile, rate_per_worker: float, forecast: LoadForecast, rho: float) -> float:
    context = forecast.mean_input_tokens + forecast.mean_output_tokens / 2
    itl = profile.itl_ms(1, context) / (1 - rho)
    for _ in range(50):
        concurrency = rate_per_worker * forecast.mean_output_tokens * itl / 1000
        updated = profile.itl_ms(max(concurrency, 1.0), context) / (1 - rho)
        if abs(updated - itl) < 1e-6:
            break
        itl = updated
    return itl


QUANTILES = 32  # points of the prompt-length distribution the prefill moments average over


def prefill_times(profile: EngineProfile, forecast: LoadForecast) -> list[float]:
    """The prefill time (ms) at evenly spaced quantiles of the uncached prompt lengths: the observed
    quantiles where the forecast has them, else a gamma distribution with the forecast's mean and
    cv² (a single point without a cv²)."""
    if forecast.uncached_quantiles:
        return [profile.ttft_ms(float(n)) for n in forecast.uncached_quantiles]
    mean = forecast.mean_uncached_tokens
    cv2 = forecast.input_tokens_cv2
    if mean <= 0 or cv2 <= 0:
        return [profile.ttft_ms(mean)]
    from scipy.stats import gamma  # scipy comes with statsmodels

    shape, scale = 1.0 / cv2, mean * cv2
    lengths = gamma.ppf([(i + 0.5) / QUANTILES for i in range(QUANTILES)], shape, scale=scale)
    return [profile.ttft_ms(float(n)) for n in lengths]


def prefill_moments(profile: EngineProfile, forecast: LoadForecast) -> tuple[float, float]:
    """E[P] and E[P²] of the prefill time over the uncached prompt lengths (ms, ms²)."""
    return _moments(prefill_times(profile, forecast))


def _moments(times: list[float]) -> tuple[float, float]:
    """The mean and the mean square of ``times``."""
    return sum(times) / len(times), sum(t * t for t in times) / len(times)


def erlang_c(workers: int, rho: float) -> float:
    """The probability that an arrival finds all ``workers`` busy (Erlang C) at utilisation ``rho``
    each: ρ for one worker, far less for several that share the arrivals."""
    if rho <= 0:
        return 0.0
    if rho >= 1:
        return 1.0
    offered = rho * workers
    blocking = 1.0  # Erlang B, by its recursion over the servers
    for k in range(1, workers + 1):
        blocking = offered * blocking / (k + offered * blocking)
    return blocking / (1 - rho * (1 - blocking))


def queue_wait(workers: int, rho: float, mean_ms: float, second_moment: float) -> tuple[float, float]:
    """(E[W] in ms, P(wait)) of a request's wait for a prefill slot on ``workers`` busy ``rho`` each
    with prefills of mean ``mean_ms`` and mean square ``second_moment``, the router sending each
    request to a free worker while one is: M/G/n, taken as the M/M/n wait scaled by (1 + cv²)/2 (Lee
    and Longton). One worker gives Pollaczek-Khinchine's wait, λ E[P²] / 2 (1 − ρ), and ρ. Counting
    the workers as that many lone queues, each waited on with probability ρ, asked a trough of long
    prompts (0.6 a second: two workers 36% busy each) for six workers to serve within 2 s the 95%
    that can be (decision 57)."""
    waiting = erlang_c(workers, rho)
    if waiting <= 0 or mean_ms <= 0:
        return 0.0, 0.0
    return waiting * second_moment / (2 * mean_ms * workers * (1 - rho)), waiting


def ttft_attainment(own_ms: list[float], wait_ms: float, waiting: float, target_ms: float) -> float:
    """The share of the requests a fleet can serve within ``target_ms`` that it does: those whose
    wait plus own time (``own_ms``: one per quantile of the requests) is within the target, among
    those whose own time alone is (0 when none is). A request whose prefill alone outlasts the target
    misses on any fleet: counting it would size the pool to make every other request wait for
    nothing, which no number of workers buys (a trough's one long prompt asked for seven workers).
    The wait is 0 with probability 1 − ``waiting`` (P(wait), :func:`queue_wait`) and otherwise taken
    as exponential with mean E[W]/P(wait) (the usual approximation of its tail), so that a request of
    own time t meets the target with probability 1 − P(wait)·exp(−(target − t)·P(wait)/E[W])."""
    if not own_ms or math.isinf(target_ms):
        return 1.0
    meetable = [own for own in own_ms if own <= target_ms]
    if not meetable:
        return 0.0
    met = 0.0
    for own in meetable:
        if waiting <= 0 or wait_ms <= 0:
            met += 1.0
        else:
            met += 1.0 - waiting * math.exp(-(target_ms - own) * waiting / wait_ms)
    return met / len(meetable)


def aggregated(
    profile: EngineProfile, forecast: LoadForecast, workers: int, ttft_target_ms: float = math.inf
) -> Estimate:
    """What ``workers`` aggregated workers would give (and the share within ``ttft_target_ms``)."""
    if forecast.request_rate <= 0:
        return Estimate(prefill_moments(profile, forecast)[0], profile.itl_ms(1, 0), 0.0)
    if workers <= 0:
        return Estimate(math.inf, math.inf, math.inf)
    per_worker = forecast.request_rate / workers
    times = prefill_times(profile, forecast)
    prefill, prefill_square = _moments(times)
    rho = per_worker * prefill / 1000
    if rho >= MAX_UTILISATION:
        return Estimate(math.inf, math.inf, rho, 0.0)
    itl = _decode_fixed_point(profile, per_worker, forecast, rho)
    budget = profile.max_num_batched_tokens  # 0: unknown (a live profile); its TTFTs hold the chunks
    chunks = max(1, math.ceil(forecast.mean_uncached_tokens / budget)) if budget > 0 else 1
    decode_share = itl * (1 - rho)  # d(c): the decode cost each prefill chunk's step also carries
    wait, waiting = queue_wait(workers, rho, prefill, prefill_square)
    # each quantile's own time: its prefill and a decode step's share per chunk (as the mean's)
    own = [t + chunks * decode_share * (t / prefill if prefill > 0 else 1.0) for t in times]
    attained = ttft_attainment(own, wait, waiting, ttft_target_ms)
    return Estimate(wait + prefill + chunks * decode_share, itl, rho, attained)


def prefill_pool(
    profile: EngineProfile, forecast: LoadForecast, workers: int, ttft_target_ms: float = math.inf
) -> Estimate:
    """What ``workers`` prefill workers would give (and the share within ``ttft_target_ms``)."""
    if workers <= 0:
        return Estimate(math.inf, 0.0, math.inf, 0.0)
    per_worker = forecast.request_rate / workers
    times = prefill_times(profile, forecast)
    prefill, prefill_square = _moments(times)
    rho = per_worker * prefill / 1000
    if rho >= MAX_UTILISATION:
        return Estimate(math.inf, 0.0, rho, 0.0)
    wait, waiting = queue_wait(workers, rho, prefill, prefill_square)
    return Estimate(prefill + wait, 0.0, rho, ttft_attainment(times, wait, waiting, ttft_target_ms))


def decode_pool(profile: EngineProfile, forecast: LoadForecast, workers: int) -> Estimate:
    if workers <= 0:
        return Estimate(0.0, math.inf, math.inf)
    itl = _decode_fixed_point(profile, forecast.request_rate / workers, forecast, 0.0)
    concurrency = forecast.request_rate / workers * forecast.mean_output_tokens * itl / 1000
    context = forecast.mean_input_tokens + forecast.mean_output_tokens
    memory = concurrency * context / profile.capacity_tokens  # KV cache share the sequences hold
    return Estimate(0.0, itl, memory)


def rate_served(meets: Callable[[float], bool], rate: float, steps: int = 20) -> float:
    """The largest request rate in [0, ``rate``] at which ``meets(rate)`` holds (taken as monotone:
    a pool that meets its limits at a rate meets them at any lower one), by bisection."""
    if meets(rate):
        return rate
    low, high = 0.0, rate
    for _ in range(steps):
        middle = (low + high) / 2
        if meets(middle):
            low = middle
        else:
            high = middle
    return low


# a limit no size meets is loosened to what the largest pool reaches, less what buys too little:
# means within 5% of its, and the share within the TTFT target within half a point of its
DIMINISHING_RETURNS = 1.05
ATTAINMENT_GIVEN_UP = 0.005


@dataclass(frozen=True)
class Limits:
    """What a pool's estimate must meet: its means, its planned utilisation, its TTFT attainment."""

    ttft_ms: float = math.inf
    itl_ms: float = math.inf
    utilisation: float = math.inf
    ttft_attainment: float = 0.0

    def met_by(self, estimate: Estimate) -> bool:
        return (
            estimate.stable
            and estimate.ttft_ms <= self.ttft_ms
            and estimate.itl_ms <= self.itl_ms
            and estimate.utilisation <= self.utilisation
            and estimate.ttft_attainment >= self.ttft_attainment
        )

    def within_reach(self, best: Estimate) -> Limits:
        """These limits, each one ``best`` does not meet loosened to near what it reaches; those it
        meets are kept as they are. Only the limit no size can meet gives way: long prompts whose
        prefill alone is over the mean's limit must not make the pool chase every other limit to the
        largest size's too (a trough of 0.6 requests a second asked for 13 workers, where 5 met the
        attainment goal)."""
        return Limits(
            max(self.ttft_ms, best.ttft_ms * DIMINISHING_RETURNS),
            max(self.itl_ms, best.itl_ms * DIMINISHING_RETURNS),
            max(self.utilisation, min(best.utilisation * DIMINISHING_RETURNS, MAX_UTILISATION)),
            min(self.ttft_attainment, best.ttft_attainment - ATTAINMENT_GIVEN_UP),
        )


def smallest_pool(estimate: Callable[[int], Estimate], limits: Limits, low: int, high: int) -> tuple[int, Estimate]:
    """The smallest size in [low, high] whose estimate meets ``limits``. When none does, the smallest
    that meets them loosened to what ``high`` workers reach (:meth:`Limits.within_reach`): adding
    workers cannot buy what the engine cannot do; else ``high``."""
    estimates = [(size, estimate(size)) for size in range(max(low, 0), high + 1)]
    for size, result in estimates:
        if limits.met_by(result):
            return size, result
    reachable = limits.within_reach(estimates[-1][1])
    for size, result in estimates:
        if reachable.met_by(result):
            return size, result
    return estimates[-1]


# ---- NVIDIA Dynamo's throughput-based sizing, as its planner design documents it (for comparison) ----


def decode_throughput_per_worker(profile: EngineProfile, itl_limit_ms: float, context_tokens: float) -> float:
    """Output tokens/s one worker gives at the most concurrency whose ITL stays within the limit."""
    best = 0.0
    concurrency = 1
    while concurrency <= 4096:
        itl = profile.itl_ms(concurrency, context_tokens)
        if itl > itl_limit_ms:
            break
        best = max(best, concurrency * 1000.0 / itl)
        concurrency *= 2 if concurrency < 8 else 1.25
        concurrency = int(concurrency)
    return best


def dynamo_shares(
    profile: EngineProfile,
    forecast: LoadForecast,
    itl_target_ms: float,
    prefill_correction: float,
    decode_correction: float,
) -> tuple[float, float]:
    """Dynamo's throughput-based scaling, as (prefill replicas, decode replicas) before rounding:
    prefill = predicted prefill tokens/s (× the prefill correction when it is below 1) ÷ the profiled
    prefill tokens/s of one worker at the mean prompt; decode = predicted output tokens/s ÷ the best
    profiled output tokens/s of one worker at ITL target ÷ decode correction. Disaggregated pools
    round each up; an aggregated worker does both, so its share is their sum."""
    if forecast.request_rate <= 0:
        return 0.0, 0.0
    prompt = max(forecast.mean_input_tokens, 1.0)
    prefill_rate = forecast.request_rate * prompt * min(1.0, prefill_correction)
    prefill_capacity = prompt / (profile.ttft_ms(prompt) / 1000.0)
    context = forecast.mean_input_tokens + forecast.mean_output_tokens / 2
    decode_capacity = decode_throughput_per_worker(profile, itl_target_ms / decode_correction, context)
    decode_rate = forecast.request_rate * forecast.mean_output_tokens
    decode_share = decode_rate / decode_capacity if decode_capacity > 0 else math.inf
    return prefill_rate / prefill_capacity, decode_share
