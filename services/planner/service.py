"""``kvmesh planner run``: every adjustment interval, merge the frontends' load reports and the
routers' per-worker loads into an observation, decide, record the step in SQLite, and resize the
fleet through the connector.

A restarted planner (kill -9 included) replays its recorded steps first and goes on from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import structlog
from nats.aio.client import Client as NatsClient
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from kvmesh.common.core.engine_profile import EngineProfile, ProfileError
from kvmesh.common.runtime.config import CommonConfig, ConfigError, option
from kvmesh.common.runtime.discovery import DiscoveryWatcher, InstanceRecord, new_instance_id
from kvmesh.common.runtime.lease import Lease
from kvmesh.common.runtime.run_file import resolve_nats_url
from kvmesh.common.runtime.service import ServiceStack
from kvmesh.common.wire import names
from kvmesh.common.wire.frontend_load import LoadReport, LoadReportError
from kvmesh.common.wire.worker_load import RouterLoadReport, WorkerLoad, WorkerLoadError, merge_router_reports
from kvmesh.planner.connector import Connector, ConnectorError
from kvmesh.planner.connectors import CONNECTORS, make_connector
from kvmesh.planner.decision import POOLS, Decision, PoolSizes
from kvmesh.planner.kubernetes import SERVICE_ACCOUNT_DIR
from kvmesh.planner.load import IntervalObservation, observe_interval
from kvmesh.planner.options import PlannerOptions
from kvmesh.planner.planner import Planner
from kvmesh.planner.state import RESUME_STEPS, PlannerState, resume
from kvmesh.planner.step_stream import JetStreamSteps

log = structlog.get_logger(__name__)
T = TypeVar("T")
STATE_STORES = ("sqlite", "nats")


@dataclass
class PlannerConfig(CommonConfig, PlannerOptions):
    """``kvmesh planner run``'s options."""

    nats_url: str | None = option(
        None, "NATS server URL (default: that of the running `kvmesh up` of the namespace, else nats://127.0.0.1:4222)"
    )
    engine_profile: Path = option(None, "engine profile from `kvmesh profile` (required)")
    state_store: str = option(
        "sqlite",
        "where the planner keeps its steps: `sqlite` (the file --state-db, this replica's own) or `nats` (the "
        "namespace's replicated JetStream stream, shared: a standby that takes the lease resumes from the steps of "
        "the planner it replaces; use it with more than one planner replica)",
        choices=STATE_STORES,
    )
    state_db: Path = option(
        Path("kvmesh-planner.sqlite"), "--state-store sqlite: the SQLite file of the planner's steps (resumed on start)"
    )
    disaggregated: bool = option(
        False,
        "size a prefill and a decode pool (workers of --role prefill and --role decode) instead of one aggregated pool",
    )
    connector: str = option("local", "how decisions reach the fleet", choices=CONNECTORS)
    no_operation: bool = option(False, "only log and record decisions (same as --connector no-operation)")
    compose_command: str = option(
        "", "--connector compose: the compose command (default: `docker compose` if installed, else `docker-compose`)"
    )
    compose_file: str = option("", "--connector compose: the mesh's compose file(s), comma-separated")
    compose_project: str = option("", "--connector compose: the project name (default: compose's, from the directory)")
    compose_service: str = option(
        "worker",
        "--connector compose: the service whose replicas are the worker pool (with --disaggregated: the decode pool)",
    )
    compose_prefill_service: str = option(
        "prefill-worker", "--connector compose --disaggregated: the service whose replicas are the prefill pool"
    )
    kubernetes_deployment: str = option(
        "worker",
        "--connector kubernetes: the Deployment whose replicas are the worker pool (with --disaggregated: the decode "
        "pool)",
    )
    kubernetes_prefill_deployment: str = option(
        "prefill-worker", "--connector kubernetes --disaggregated: the Deployment whose replicas are the prefill pool"
    )
    kubernetes_namespace: str = option(
        "", "--connector kubernetes: the Deployments' namespace (default: the planner pod's own)"
    )
    kubernetes_credentials: Path = option(
        SERVICE_ACCOUNT_DIR,
        "--connector kubernetes: the folder of the service account's token, ca.crt and namespace (the API server "
        "is $KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT, as for every in-cluster client)",
    )
    kubernetes_departure_blocks: int = option(
        0,
        "--connector kubernetes: before a shrink, mark each of the pool's worker pods with what its departure "
        "loses, how many of its N hottest cached blocks no other worker of the pool holds, as its "
        "controller.kubernetes.io/pod-deletion-cost, so that the ReplicaSet stops the pod that loses least (the "
        "workers need --pod-name, and --shrink-handoff-blocks N to hand those blocks on as they stop; the "
        "planner's Role must allow patch on pods); 0: the ReplicaSet picks alone",
    )
    planner_lease_secs: float = option(
        15.0,
        "one planner acts at a time: it holds a lease in NATS for this long, renewed while it runs; another planner "
        "of the namespace stands by and takes over within two of these after the holder dies",
    )
    metrics_host: str = option("127.0.0.1", "address of the Prometheus /metrics endpoint")
    metrics_port: int = option(0, "Prometheus /metrics port (0: a free port, -1: off)")

    def validate(self) -> None:
        PlannerOptions.validate(self)
        if self.engine_profile is None:
            raise ConfigError("--engine-profile is required (write one with `kvmesh profile`)")
        if self.planner_lease_secs < 1:
            raise ConfigError("--planner-lease-secs must be at least 1")
        if self.kubernetes_departure_blocks < 0:
            raise ConfigError("--kubernetes-departure-blocks must be 0 (off) or positive")
        if self.kubernetes_departure_blocks and self.connector_name() != "kubernetes":
            raise ConfigError(
                "--kubernetes-departure-blocks is for --connector kubernetes (under `kvmesh up --planner`, "
                "--shrink-handoff-blocks picks the cheapest departure)"
            )
        if (
            self.connector_name() == "compose"
            and self.disaggregated
            and self.compose_prefill_service == self.compose_service
        ):
            raise ConfigError("--compose-prefill-service and --compose-service must name different services")
        if (
            self.connector_name() == "kubernetes"
            and self.disaggregated
            and self.kubernetes_prefill_deployment == self.kubernetes_deployment
        ):
            raise ConfigError("--kubernetes-prefill-deployment and --kubernetes-deployment must name different ones")

    def connector_name(self) -> str:
        return "no-operation" if self.no_operation else self.connector


class PlannerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def gauge(name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
            return Gauge(f"kvmesh_planner_{name}", doc, labels, registry=self.registry)

        self.observed_rate = gauge("observed_request_rate", "requests/s the last interval")
        self.predicted_rate = gauge("predicted_request_rate", "requests/s predicted for the interval sized for")
        self.attainment = gauge("sla_attainment", "share of the last interval's finished requests meeting both targets")
        self.window_attainment = gauge(
            "window_sla_attainment", "share of the requests finished within --attainment-window meeting both targets"
        )
        self.current = gauge("workers", "workers in the pool when the planner decided", ["pool"])
        self.wanted = gauge("wanted_workers", "workers the model asked for", ["pool"])
        self.target = gauge("target_workers", "workers the planner set (after hysteresis)", ["pool"])
        self.cap = gauge("utilisation_cap", "prefill utilisation a worker may be planned at")
        self.startup = gauge(
            "worker_startup_seconds", "a worker's start-up the planner plans for (measured, else --worker-startup-secs)"
        )
        self.worker_requests = gauge(
            "worker_requests", "requests in flight on a worker, the last interval's mean (routers' view)", ["worker"]
        )
        self.worker_kv_tokens = gauge(
            "worker_kv_tokens",
            "KV tokens a worker's requests held, the last interval's mean (routers' view)",
            ["worker"],
        )

    def record(
        self, decision: Decision, observed_rate: float, attainment: float | None, loads: Sequence[WorkerLoad] = ()
    ) -> None:
        self.observed_rate.set(observed_rate)
        self.predicted_rate.set(decision.forecast.request_rate)
        if attainment is not None:
            self.attainment.set(attainment)
        if decision.window_attainment is not None:
            self.window_attainment.set(decision.window_attainment)
        for pool in POOLS:
            self.current.labels(pool).set(getattr(decision.current, pool))
            self.wanted.labels(pool).set(getattr(decision.wanted, pool))
            self.target.labels(pool).set(getattr(decision.target, pool))
        self.cap.set(decision.utilisation_cap)
        if decision.worker_startup_s is not None:
            self.startup.set(decision.worker_startup_s)
        # workers come and go: only those of the last interval keep a series
        self.worker_requests.clear()
        self.worker_kv_tokens.clear()
        for load in loads:
            worker = f"{load.worker_id}" if not load.dp_rank else f"{load.worker_id}/{load.dp_rank}"
            self.worker_requests.labels(worker).set(load.requests)
            self.worker_kv_tokens.labels(worker).set(load.kv_tokens)


def registered_pools(records: Iterable[InstanceRecord]) -> PoolSizes:
    """The workers discovery shows, counted by role (a worker without a role is aggregated)."""
    roles = Counter(record.role or "aggregated" for record in records)
    return PoolSizes(**{pool: roles[pool] for pool in POOLS})


def pools_text(pools: PoolSizes) -> str:
    """``"3"`` for an aggregated fleet, ``"2P+3D"`` for a disaggregated one (for the logs)."""
    if pools.prefill or pools.decode:
        return f"{pools.prefill}P+{pools.decode}D" + (f"+{pools.aggregated}A" if pools.aggregated else "")
    return str(pools.aggregated)


async def collect(
    stack: ServiceStack, nc: NatsClient, subject: str, decode: Callable[[bytes], T], what: str
) -> list[T]:
    """A list that every report decoded from ``subject`` is appended to, until the stack closes; a
    message that is not such a report is logged and skipped."""
    received: list[T] = []

    async def on_message(message) -> None:
        try:
            received.append(decode(message.data))
        except (LoadReportError, WorkerLoadError) as exc:
            log.warning(f"ignored a message on the {what} subject", error=str(exc))

    subscription = await nc.subscribe(subject, cb=on_message)
    stack.push_async_callback(subscription.unsubscribe)
    return received


def merge(reports: Sequence[LoadReport]) -> tuple[int, list]:
    return sum(r.arrivals for r in reports), [s for r in reports for s in r.samples]


class Clock:
    """When the planner decides (every ``interval_s``) and when it looks between decisions (every
    ``look_s`` after one; 0, or ``interval_s`` or more: never)."""

    def __init__(self, interval_s: float, look_s: float) -> None:
        self.interval_s = interval_s
        self.look_s = look_s if 0 < look_s < interval_s else math.inf
        self.interval_start = time.time()  # wall clock: the observations' times
        self._decide_at = time.monotonic() + interval_s
        self._look_at = time.monotonic() + self.look_s

    def until_next(self) -> float:
        """Seconds to the next look or decision."""
        return max(0.0, min(self._decide_at, self._look_at) - time.monotonic())

    def looking(self) -> bool:
        """After a wake-up: True for a look; False for a decision, which starts the next interval."""
        now = time.monotonic()
        if now < self._decide_at:
            self._look_at += self.look_s
            return True
        self._decide_at = now + self.interval_s
        self._look_at = now + self.look_s
        self.interval_start = time.time()
        return False


async def look(
    planner: Planner, partial: IntervalObservation, connector: Connector, registered: PoolSizes, lease: Lease
) -> None:
    """A look at the interval so far (``--growth-look-secs``, decision 65): the pools clearly behind
    the goal grow now; the fleet is read only then (a connector may be slow to ask)."""
    behind = planner.look(partial)
    if not behind:
        return
    try:
        current = await connector.current(registered)
    except ConnectorError as exc:
        log.error("cannot read the fleet; skipping this look", error=str(exc))
        return
    target = planner.grow(partial, behind, current)
    if target is None or not lease.held():
        return
    log.info(
        "planner look: growing before the interval ends",
        seconds_into_interval=round(partial.duration_s, 1),
        finished=partial.finished,
        attainment=partial.sla_attainment,
        observed_rate=round(partial.request_rate, 3),
        workers=pools_text(current),
        target=pools_text(target),
    )
    try:
        now_pools = await connector.scale(target)
        log.info("scaled", workers=pools_text(now_pools))
    except ConnectorError as exc:
        log.error("scaling failed", error=str(exc))


async def serve(config: PlannerConfig, stop: asyncio.Event) -> None:
    try:
        profile = EngineProfile.load(config.engine_profile)
    except ProfileError as exc:
        raise SystemExit(f"kvmesh planner: {exc}") from exc
    config.nats_url, source = resolve_nats_url(config.nats_url, config.namespace)
    log.info("NATS", url=config.nats_url, source=source)
    async with ServiceStack() as stack:
        nc = await stack.nats(config, "kvmesh-planner")
        if config.state_store == "nats":
            state: PlannerState | JetStreamSteps = await stack.enter_async_context(JetStreamSteps(nc, config.namespace))
        else:
            state = await stack.enter_async_context(PlannerState(config.state_db))
        # enough steps for the predictors and for the SLA's window (its misses decide shrinks)
        window_steps = math.ceil(config.attainment_window / config.adjustment_interval)

        async def resumed_planner() -> Planner:
            """A planner that has lived through the recorded steps: it decides as the one that recorded
            them would have."""
            fresh = Planner(config, profile, disaggregated=config.disaggregated)
            history = await state.recent(max(RESUME_STEPS, window_steps))
            last = resume(fresh, history)
            if last is not None:
                log.info("resumed", steps=len(history), pools=last.target.total, utilisation_cap=last.utilisation_cap)
            return fresh

        # SQLite holds this replica's own steps: resumed once, now. The shared stream holds the acting
        # replica's: resumed each time this one takes the lease, from every step recorded till then.
        planner = await resumed_planner() if config.state_store == "sqlite" else None
        workers = await stack.start(DiscoveryWatcher(nc.jetstream(), config.namespace, "worker"))
        reports = await collect(stack, nc, names.load_report_subject(config.namespace), LoadReport.decode, "load")
        router_reports = await collect(
            stack, nc, names.router_load_subject(config.namespace), RouterLoadReport.decode, "router load"
        )
        try:
            connector = make_connector(config, nc)
        except ConnectorError as exc:
            raise SystemExit(f"kvmesh planner: {exc}") from exc
        metrics = PlannerMetrics()
        if config.metrics_port >= 0:
            server, _ = start_http_server(config.metrics_port, addr=config.metrics_host, registry=metrics.registry)
            stack.callback(server.shutdown)
            log.info("metrics", url=f"http://{config.metrics_host}:{server.server_port}/metrics")
        owner = f"{socket.gethostname()}:{os.getpid()}:{new_instance_id()}"
        lease = await stack.start(
            Lease(
                nc.jetstream(),
                names.PLANNER_LEASE_BUCKET,
                f"{config.namespace}.planner",
                owner,
                config.planner_lease_secs,
            )
        )
        log.info("planner ready", connector=config.connector_name(), interval_s=config.adjustment_interval)
        started = time.time()
        acting: bool | None = None  # None: not known yet, so the first interval logs which it is
        clock = Clock(config.adjustment_interval, config.growth_look_secs)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=clock.until_next())
            if stop.is_set():
                break
            looking = clock.looking()  # else deciding: the wake-up ends the interval
            if lease.held() != acting:
                acting = lease.held()
                log.info(
                    "this planner acts now (it holds the lease)" if acting else "another planner acts; standing by"
                )
                if acting and config.state_store == "nats":
                    planner = await resumed_planner()
            if not acting:
                reports[:], router_reports[:] = [], []  # the acting planner counts them
                started = clock.interval_start = time.time()  # a look after taking over sees from here
                continue
            assert planner is not None  # resumed at the start, or on taking the lease
            if looking:
                registered = registered_pools(workers.instances())
                partial = observe_interval(
                    *merge(reports),
                    clock.interval_start,
                    time.time() - clock.interval_start,
                    config.ttft_target_ms,
                    config.itl_target_ms,
                    registered.total,
                )
                await look(planner, partial, connector, registered, lease)
                continue
            now = time.time()
            taken, reports[:] = list(reports), []
            arrivals, samples = merge(taken)
            taken_loads, router_reports[:] = list(router_reports), []
            worker_loads = merge_router_reports(taken_loads)
            registered = registered_pools(workers.instances())
            try:
                current = await connector.current(registered)
            except ConnectorError as exc:
                log.error("cannot read the fleet; skipping this interval", error=str(exc))
                continue
            observation = observe_interval(
                arrivals,
                samples,
                max(started, now - config.adjustment_interval),
                config.adjustment_interval,
                config.ttft_target_ms,
                config.itl_target_ms,
                registered.total,
                worker_loads,
            )
            decision = planner.step(observation, current)
            await state.record(observation, decision)
            metrics.record(decision, observation.request_rate, observation.sla_attainment, worker_loads)
            log.info(
                "planner decision",
                observed_rate=round(observation.request_rate, 3),
                finished=len(samples),
                attainment=observation.sla_attainment,
                # the SLA's window: pools shrink only while it is above the goal with room to spare
                window_attainment=decision.window_attainment,
                predicted_rate=round(decision.forecast.request_rate, 3),
                workers=pools_text(current),
                registered=pools_text(registered),
                wanted=pools_text(decision.wanted),
                target=pools_text(decision.target),
                utilisation_cap=round(decision.utilisation_cap, 3),
                worker_startup_s=decision.worker_startup_s,
                # per worker: mean requests in flight and KV tokens held, as the routers predicted
                worker_requests={w.worker_id: round(w.requests, 1) for w in worker_loads},
                worker_kv_tokens={w.worker_id: round(w.kv_tokens) for w in worker_loads},
            )
            if decision.changes:
                if not lease.held():  # lost while deciding: the planner that took over decides anew
                    log.warning("lease lost before scaling; this decision is not applied")
                    continue
                try:
                    now_pools = await connector.scale(decision.target)
                    log.info("scaled", workers=pools_text(now_pools), connector=config.connector_name())
                except ConnectorError as exc:
                    log.error("scaling failed", error=str(exc))
