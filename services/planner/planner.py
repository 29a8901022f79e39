"""The planner's decision loop, without I/O: an observation in, a decision out.

Each interval it (1) feeds the observation to its predictors, (2) predicts the highest rate until a
worker started now would join (decision 57), and the prompt and output lengths and prefix hits, (3)
corrects its performance model by how far the last interval's observed TTFT / ITL were from what the
model says for that interval's load and fleet, and (4) sizes each pool as the smallest that meets
the targets, then (5) puts the SLA first (decision 38): it grows at once, and grows the pool at
fault by one whenever an interval measured attainment below the goal (by more than chance explains
while the SLA's window has misses to spare: decision 66), whatever the model says; it
shrinks only to a size that meets a stricter utilisation cap, only after ``scale_down_intervals``
intervals in a row asked for less, and one worker a decision, only with headroom measured (not
predicted) since the pools last changed, and only while the requests finished within
``--attainment-window`` met the goal with room to spare (a shrink spends some), the intervals since
the pools last changed missed almost nothing (decision 68), or the pool one smaller would run far
from capacity (``--idle-shrink-utilisation``). A pool the model plans far from
capacity at a smaller size shrinks to it in one decision (at most by half). Between decisions it
looks at the interval so far and grows a pool clearly behind the goal at once (decision 65).

The model speaks of means, the SLA of each request; what lies between (requests whose few decode
steps meet a long prefill chunk, a cache that holds less in a smaller fleet) is learned from the
measured attainment as a cap on the prefill utilisation a worker may be planned at: a steady interval
below ``--attainment-goal`` lowers the cap (×0.85), one comfortably above raises it (×1.05), within
[0.1, 0.9]. The pool is the larger of what the limits and what the cap ask for.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvmesh.common.core.engine_profile import EngineProfile
from kvmesh.planner import capacity, correction, growth_look, sizing
from kvmesh.planner.decision import POOLS, Decision, PoolSizes
from kvmesh.planner.load import IntervalObservation, LoadForecast
from kvmesh.planner.miss_budget import MissBudget, pooled, unservable
from kvmesh.planner.options import UTILISATION_CAP_BOUNDS, PlannerOptions
from kvmesh.planner.predictors import Predictor, make_predictor
from kvmesh.planner.startup import StartupMeter

TIGHTEN, RELAX = 0.85, 1.05
ATTAINMENT_SLACK = 0.02  # relax only above goal + this
BACKLOG_DRAIN_INTERVALS = 2  # a backlog is planned to drain within this many intervals
FORECAST_TOLERANCE = 0.25  # an interval whose rate was forecast closer than this teaches the cap
MIN_FINISHED_FOR_FEEDBACK = 10
# headroom is measured over at least this many finished requests (the recent intervals back until
# they add up to it): fewer say too little about a 0.95 goal
HEADROOM_REQUESTS = 40
SHRINK_HEADROOM = 0.03  # a pool shrinks only where the attainment was measured this far above the goal
# a pool shrinks near capacity only while the attainment over --attainment-window is this far above
# the goal: a shrink spends some, and a window that has none must not pay for savings with misses
BUDGET_MARGIN = 0.01
KEPT_OBSERVATIONS = 64


@dataclass
class _Series:
    rate: Predictor
    input_tokens: Predictor
    output_tokens: Predictor
    prefix_hit: Predictor
    input_cv2: Predictor


@dataclass
class Planner:
    """Guarantees: targets stay within [min_workers, max_workers] per pool; a pool never shrinks
    before ``scale_down_intervals`` intervals in a row asked for fewer, nor while the attainment over
    ``attainment_window`` is below the goal + ``BUDGET_MARGIN`` unless the model plans the pool one
    smaller at most ``idle_shrink_utilisation`` busy or the intervals since the pools last changed
    missed almost nothing (decision 68), nor by more than one worker a decision except to a
    size the model plans that idle (and never by more than half); the same observations give the same decisions
    (a restarted planner replays its stored observations to resume)."""

    options: PlannerOptions
    profile: EngineProfile
    disaggregated: bool = False
    ttft_correction: float = 1.0
    itl_correction: float = 1.0
    utilisation_cap: float = field(init=False)
    _series: _Series = field(init=False)
    _recent_wanted: list[PoolSizes] = field(default_factory=list, init=False)
    _recent_held: list[bool] = field(default_factory=list, init=False)  # whether each interval's forecast held
    _last_pools: PoolSizes | None = field(default=None, init=False)
    _last_forecast: LoadForecast | None = field(default=None, init=False)
    _backlog: float = field(default=0.0, init=False)
    _recent_quantiles: list[tuple[float, ...]] = field(default_factory=list, init=False)
    _recent_observations: list[IntervalObservation] = field(default_factory=list, init=False)
    # the requests finished within --attainment-window, and the misses sizing can spend
    _budget: MissBudget = field(init=False)
    _grown_at: dict[str, float] = field(default_factory=dict, init=False)
    _startup: StartupMeter = field(init=False)
    _resized_at: float = field(default=-math.inf, init=False)  # the last decision that changed a pool

    def __post_init__(self) -> None:
        o = self.options
        self.utilisation_cap = o.utilisation_cap
        self._budget = MissBudget(o.attainment_goal, o.attainment_window)
        self._startup = StartupMeter(o.worker_startup_secs)

        def rate() -> Predictor:
            return make_predictor(o.load_predictor, o.predictor_window, o.season_length)

        def shape() -> Predictor:
            # request shapes drift slowly and noisily: a trend fitted to them overshoots
            return make_predictor("moving-average", o.predictor_window)

        self._series = _Series(rate(), shape(), shape(), shape(), shape())

    def step(self, observation: IntervalObservation, current: PoolSizes) -> Decision:
        self._correct(observation, current)
        # an interval the fleet spent changing size, or whose load the forecast missed, says how the
        # planner lagged, not how the model errs: only a steady, well-forecast one moves the cap
        held = self._forecast_held(observation)
        self._recent_held = [*self._recent_held, held][-self.options.scale_down_intervals :]
        if current == self._last_pools and held and not observation.backlog_growth:
            self._feedback(observation)
        self._observe(observation)
        self._startup.observed(observation.start_s + observation.duration_s, observation.workers)
        self._track_backlog(observation)
        forecast = self.forecast()
        load = self._with_backlog(forecast)
        wanted, ttft, itl = self._size(load)
        now = observation.start_s + observation.duration_s
        wanted = self._grow_on_missed_goal(observation, wanted, current, now)
        target = self._hysteresis(self._deadband(wanted, current, load), current, load)
        for pool in POOLS:
            if getattr(target, pool) > getattr(current, pool):
                self._grown_at[pool] = now
        self._startup.decided(now, current.total, target.total)
        if target != current:
            self._resized_at = now
        self._last_pools = target
        self._last_forecast = forecast
        return Decision(
            now,
            forecast,
            wanted,
            target,
            current,
            ttft,
            itl,
            self.ttft_correction,
            self.itl_correction,
            self.utilisation_cap,
            self.window_attainment(),
            self.worker_startup_s,
        )

    def look(self, partial: IntervalObservation) -> list[str]:
        """A look between decisions (:mod:`growth_look`) at ``partial``, the interval so far: measures a
        start-up to it, and names the pools clearly behind the goal while the SLA's window has no misses
        to spare and no worker added to them is still starting; none with Dynamo's sizing. Not resumed."""
        now = partial.start_s + partial.duration_s
        self._startup.observed(now, partial.workers)  # a start-up measured to the look, not the interval
        clearly_below = growth_look.clearly_below(self.options.attainment_goal, partial.finished)
        if self.options.sizing != "queue" or self._window_spare() or not clearly_below(self._judged([partial])):
            return []
        return self._settled(growth_look.pools_at_fault(partial, self.disaggregated, clearly_below), now)

    def grow(self, partial: IntervalObservation, behind: list[str], current: PoolSizes) -> PoolSizes | None:
        """The pools ``behind`` (:meth:`look`) grown to what the model asks for at the load seen in
        ``partial``, at least by one, within their ceilings (None: none can grow)."""
        now = partial.start_s + partial.duration_s
        drain_s = BACKLOG_DRAIN_INTERVALS * self.options.adjustment_interval
        wanted = self._size(growth_look.seen_load(partial, self._backlog, drain_s))[0]
        sizes = growth_look.one_more(behind, wanted, current, self.options)
        grown = {pool: size for pool, size in sizes.items() if size > getattr(current, pool)}
        if not grown:
            return None
        self._grown_at |= dict.fromkeys(grown, now)
        target = dataclasses.replace(current, **grown)
        self._startup.decided(now, current.total, target.total)
        self._resized_at = now
        return target

    @property
    def worker_startup_s(self) -> float:
        """The worker start-up planned for: measured (:class:`StartupMeter`), else the option's guess."""
        return self._startup.seconds

    def forecast(self) -> LoadForecast:
        """The load the pools decided now must serve: the highest rate predicted until workers
        started now would join. Growth must be there when the load is; a shrink takes effect at once
        and cannot be undone faster than a start-up, so a falling trend's far end (a damped trend
        that forecast 0 in prompts-2x's trough, where 0.5 requests a second still came) is no reason
        to shrink now."""
        s = self._series
        o = self.options
        horizon = 1 + math.ceil(self.worker_startup_s / o.adjustment_interval)
        return LoadForecast(
            request_rate=max(0.0, s.rate.peak(horizon)),
            mean_input_tokens=max(0.0, s.input_tokens.predict()),
            mean_output_tokens=max(1.0, s.output_tokens.predict()),
            prefix_hit_fraction=min(max(s.prefix_hit.predict(), 0.0), 1.0),
            input_tokens_cv2=max(0.0, s.input_cv2.predict()),
            # the recent intervals' quantiles, averaged point by point (a shape, as the means above)
            uncached_quantiles=tuple(sum(points) / len(points) for points in zip(*self._recent_quantiles, strict=True)),
        )

    # ---- steps -----------------------------------------------------------------------------------
    def _observe(self, observation: IntervalObservation) -> None:
        s = self._series
        s.rate.observe(observation.request_rate)
        if observation.requests:  # an idle interval says nothing about request shapes
            s.input_tokens.observe(observation.mean_input_tokens)
            s.output_tokens.observe(observation.mean_output_tokens)
            s.prefix_hit.observe(observation.prefix_hit_fraction)
            s.input_cv2.observe(observation.input_tokens_cv2)
        if observation.uncached_quantiles:
            window = self.options.predictor_window
            self._recent_quantiles = [*self._recent_quantiles, observation.uncached_quantiles][-window:]
        self._recent_observations = [*self._recent_observations, observation][-KEPT_OBSERVATIONS:]
        self._budget.add(observation, self._unservable(observation))

    def window_attainment(self) -> float | None:
        """The attainment of the requests finished within ``--attainment-window`` (None: none)."""
        return self._budget.attainment()

    def _unservable(self, observation: IntervalObservation) -> int:
        """The interval's TTFT misses whose prefill alone (the model's, as corrected, never slowed
        past the profile) outlasts the target. The correction is observed ÷ modelled TTFT, so queue
        waits raise it too; uncapped, a crest start's 1.5-1.9 called queued prompts unservable and the
        planner stopped counting its own shortfall (prompts-2x: 16 workers through the crest)."""
        return unservable(
            observation,
            lambda tokens: self.profile.ttft_ms(tokens) * min(self.ttft_correction, 1.0),
            self.options.ttft_target_ms,
        )

    def _judged(self, observations: Iterable[IntervalObservation]) -> float | None:
        """The intervals' pooled attainment with their unservable misses charged at the window's
        share of them (:meth:`MissBudget.judged`)."""
        return self._budget.judged(pooled((o, self._unservable(o)) for o in observations))

    def _correct(self, observation: IntervalObservation, current: PoolSizes) -> None:
        """Move the corrections toward observed ÷ modelled for the interval just seen (:mod:`correction`)."""
        self.ttft_correction, self.itl_correction = correction.corrected(
            (self.ttft_correction, self.itl_correction),
            observation,
            current,
            self.profile,
            disaggregated=self.disaggregated,
            dynamo=self.options.sizing == "dynamo",
        )

    def _track_backlog(self, observation: IntervalObservation) -> None:
        """Requests queued beyond what the fleet finishes: they grow while arrivals outrun
        completions and shrink as the fleet catches up."""
        self._backlog = max(0.0, self._backlog + observation.requests - observation.finished)

    def _with_backlog(self, forecast: LoadForecast) -> LoadForecast:
        """Size for the forecast rate plus draining the backlog within ``BACKLOG_DRAIN_INTERVALS``."""
        if not self._backlog:
            return forecast
        drain_rate = self._backlog / (BACKLOG_DRAIN_INTERVALS * self.options.adjustment_interval)
        return dataclasses.replace(forecast, request_rate=forecast.request_rate + drain_rate)

    def _forecast_held(self, observation: IntervalObservation) -> bool:
        last = self._last_forecast
        if last is None or last.request_rate <= 0:
            return False
        return abs(observation.request_rate - last.request_rate) <= FORECAST_TOLERANCE * last.request_rate

    def _feedback(self, observation: IntervalObservation) -> None:
        attained = self._judged([observation])
        if attained is None or observation.requests < MIN_FINISHED_FOR_FEEDBACK:
            return
        low, high = UTILISATION_CAP_BOUNDS
        if attained < self.options.attainment_goal:
            self.utilisation_cap = max(low, self.utilisation_cap * TIGHTEN)
        elif attained > self.options.attainment_goal + self._budget.margin(ATTAINMENT_SLACK):
            self.utilisation_cap = min(high, self.utilisation_cap * RELAX)

    def _size(self, forecast: LoadForecast, cap_margin: float = 1.0) -> tuple[PoolSizes, float, float]:
        """The pools the model asks for under ``forecast`` (with the cap × ``cap_margin``)."""
        return sizing.smallest_pools(
            self.profile,
            self.options,
            forecast,
            self.disaggregated,
            (self.ttft_correction, self.itl_correction),
            self.utilisation_cap * cap_margin,
        )

    def _grow_on_missed_goal(
        self, observation: IntervalObservation, wanted: PoolSizes, current: PoolSizes, now: float
    ) -> PoolSizes:
        """SLA first: when the interval just measured missed the attainment goal, the pool at fault
        grows by one whatever the model says (aggregated: the pool; disaggregated: the prefill pool
        for TTFT misses, the decode pool for ITL misses). While the SLA's window has misses to spare,
        only an interval below the goal by more than chance explains (as a look judges one): one miss
        short in 72 requests held a worker for minutes. Not again before a worker it added has joined
        (:meth:`_settled`)."""
        o = self.options
        if o.sizing != "queue" or not self._missed(observation):
            return wanted
        missed = growth_look.below(o.attainment_goal)
        if self._window_spare():  # the window's spare misses pay for an interval short by chance
            missed = growth_look.clearly_below(o.attainment_goal, observation.finished)
            if not missed(self._judged([observation])):
                return wanted
        at_fault = growth_look.pools_at_fault(observation, self.disaggregated, missed)
        return dataclasses.replace(wanted, **growth_look.one_more(self._settled(at_fault, now), wanted, current, o))

    def _window_spare(self) -> bool:
        """Whether the SLA's window has misses to spare: measured ``BUDGET_MARGIN`` above the goal."""
        window = self.window_attainment()
        return window is not None and window >= self.options.attainment_goal + self._budget.margin(BUDGET_MARGIN)

    def _settled(self, pools: list[str], now: float) -> list[str]:
        """``pools`` less those a worker added to has not joined yet (``worker_startup_s``): until it
        has, more misses are the same shortfall."""
        return [pool for pool in pools if now - self._grown_at.get(pool, -math.inf) >= self.worker_startup_s]

    @staticmethod
    def _measured(observation: IntervalObservation) -> bool:
        """Whether enough requests finished in the interval for its attainment to say something."""
        return observation.sla_attainment is not None and observation.finished >= MIN_FINISHED_FOR_FEEDBACK

    def _missed(self, observation: IntervalObservation) -> bool:
        """Whether the interval measured (:meth:`_measured`) an attainment below the goal, judged
        with its unservable misses charged at their share (:meth:`_judged`)."""
        attained = self._judged([observation])
        return self._measured(observation) and attained is not None and attained < self.options.attainment_goal

    def _headroom_measured(self, load: LoadForecast) -> bool:
        """Whether the intervals since the pools last changed measured attainment above the goal (+
        ``SHRINK_HEADROOM``): pooled over the newest of them back until ``HEADROOM_REQUESTS``
        finished (at least ``scale_down_intervals`` intervals), none of them measured below the goal.
        A pool shrinks only then, and only while the SLA's window (``window_attainment``) is
        ``BUDGET_MARGIN`` above the goal, those intervals missed almost nothing with the load as
        forecast (:meth:`MissBudget.missing_little`) or the pool one smaller would run far from capacity
        (:meth:`_idle_after_one_less`). Too few requests since the change is no headroom (the model's
        word is not enough), unless nothing arrived at all in the last intervals: an idle fleet has it."""
        intervals = self.options.scale_down_intervals
        newest = self._recent_observations[-intervals:]
        if len(newest) == intervals and not self._backlog and all(o.requests == 0 for o in newest):
            return True  # nothing arrived: an idle fleet has the headroom, whatever came before
        window: list[IntervalObservation] = []
        finished = 0
        for observation in reversed(self._recent_observations):
            if observation.start_s < self._resized_at:
                break  # measured on other pools than these
            window.append(observation)
            finished += observation.finished
            if finished >= HEADROOM_REQUESTS and len(window) >= intervals:
                break
        if len(window) < intervals or finished < HEADROOM_REQUESTS:
            return False
        attained = self._judged(window)
        # decision 68: holding a pool that now misses almost nothing undoes none of the misses the
        # window holds (a crest start's, before any worker could join); on bursts, though, what the
        # intervals measured says little of the next ones
        steady = len(self._recent_held) == intervals and all(self._recent_held)
        quiet = steady and self._budget.missing_little(attained)
        # an empty window has spent nothing: here it counts as spare, unlike for growth
        spare = self.window_attainment() is None or self._window_spare() or quiet
        if not spare and not self._idle_after_one_less(load):
            return False  # the SLA's window has no misses to spare for a shrink near capacity
        headroom = self.options.attainment_goal + self._budget.margin(SHRINK_HEADROOM)
        return attained is not None and attained >= headroom and not any(self._missed(o) for o in window)

    def _idle_after_one_less(self, load: LoadForecast) -> bool:
        """Whether the model plans the aggregated pool one smaller at most ``--idle-shrink-utilisation``
        busy for the load sized for now: a shrink so far from capacity risks no miss, so the window's
        budget does not hold it (misses spent at a crest start kept a fleet large through the trough)."""
        size = self._last_pools.aggregated if self._last_pools is not None else 0
        return self._idle_at(load, size - 1)

    def _idle_at(self, load: LoadForecast, size: int) -> bool:
        """Whether the model plans an aggregated pool of ``size`` at most ``--idle-shrink-utilisation``
        busy for ``load``."""
        low = self.options.idle_shrink_utilisation
        if not low or self.disaggregated or size < 1:
            return False
        return capacity.aggregated(self.profile, load, size).utilisation <= low

    def _far_from_capacity(self, now: int, most: int, load: LoadForecast) -> int | None:
        """The size an aggregated pool of ``now`` far from capacity shrinks to in one decision: the
        smallest from ``most`` (the most the recent intervals asked for) and at least half the pool
        that the model plans at most ``--idle-shrink-utilisation`` busy (None: no such size, or a
        recent interval measured a miss, or a backlog waits). One worker a decision, each after 40
        requests measured, took a pool of 11 the whole trough to come down at 0.5 requests a second;
        a size a fifth busy is not near the edge where headroom measured at n says nothing of n − 2."""
        recent = self._recent_observations[-self.options.scale_down_intervals :]
        if self._backlog or any(self._missed(o) for o in recent):
            return None
        for size in range(max(most, math.ceil(now / 2)), now):
            if self._idle_at(load, size):
                return size
        return None

    def _room_for_one_less(self, size: int) -> bool:
        """Whether the latencies measured in the last interval, scaled by the square of the load each
        worker of a pool of ``size`` would gain if one left (``size / (size - 1)``), stay within the
        targets: its TTFT p90 and ITL p90. Headroom measured at two workers says little about one,
        which carries twice the load, and a queue's waits grow faster than its load."""
        if size <= 1 or not self._recent_observations:
            return False
        last = self._recent_observations[-1]
        if not last.finished:
            return not last.requests and not self._backlog  # idle: the room is there
        gain = (size / (size - 1)) ** 2  # a queue's waits grow faster than its load: squared, as a margin
        o = self.options
        return last.ttft_p90_ms * gain <= o.ttft_target_ms and last.itl_p90_ms * gain <= o.itl_target_ms

    def _deadband(self, wanted: PoolSizes, current: PoolSizes, load: LoadForecast) -> PoolSizes:
        """A pool that would shrink shrinks only to the size a stricter cap (× ``shrink_margin``)
        allows. The queue's response is steep near the cap — four workers to three raises each
        one's utilisation by a third — so a pool shrunk to the edge missed, the misses tightened the
        cap, and it grew back past where it had been. Growing still happens at the cap itself."""
        shrinking = [pool for pool in POOLS if getattr(wanted, pool) < getattr(current, pool)]
        if not shrinking or self.options.shrink_margin >= 1:
            return wanted
        strict, _, _ = self._size(load, self.options.shrink_margin)
        kept = {pool: min(getattr(current, pool), getattr(strict, pool)) for pool in shrinking}
        return dataclasses.replace(wanted, **kept)

    def _hysteresis(self, wanted: PoolSizes, current: PoolSizes, load: LoadForecast) -> PoolSizes:
        self._recent_wanted = [*self._recent_wanted, wanted][-self.options.scale_down_intervals :]
        full = len(self._recent_wanted) == self.options.scale_down_intervals

        def pool(name: str) -> int:
            now, want = getattr(current, name), getattr(wanted, name)
            if want >= now:
                return want
            # shrink only if every recent interval asked for less, to the most they asked for, and
            # by one worker a decision (headroom measured at n says nothing of n - 2) unless the pool
            # is far from capacity
            most = max(getattr(w, name) for w in self._recent_wanted)
            if not full or most >= now:
                return now
            if self.options.sizing == "queue":
                far = self._far_from_capacity(now, most, load) if name == "aggregated" else None
                if far is not None:
                    return far
                if not (self._headroom_measured(load) and self._room_for_one_less(now)):
                    return now
            return max(most, now - 1)

        return PoolSizes(pool("aggregated"), pool("prefill"), pool("decode"))
