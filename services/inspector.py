"""``kvmesh inspect indexer|worker|router|jetstream``: what each indexer replica, worker or router replica
holds or sees, found through discovery (on the NATS server of the running ``kvmesh up`` by default), or
how the JetStream state kvmesh keeps is replicated."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from typing import Any

import grpc
import nats.errors
import nats.js.errors

from kvmesh.common.core.timing import from_constants
from kvmesh.common.proto.kvmesh.v1 import (
    indexer_pb2,
    indexer_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from kvmesh.common.rpc.grpc_server import channel_to
from kvmesh.common.runtime.discovery import registered_now
from kvmesh.common.runtime.jetstream_state import cluster_size, kvmesh_streams
from kvmesh.common.runtime.process import NATS_CONNECT_TIMEOUT_ENV, connect_nats
from kvmesh.common.runtime.run_file import default_namespace, resolve_nats_url
from kvmesh.common.runtime.structured_logging import configure_logging
from kvmesh.common.wire import names
from kvmesh.common.wire.step_timing import SPEED_CLASS_KEY


async def _instances(nats_url: str, namespace: str, component: str):
    nc = await connect_nats(nats_url, name="kvmesh-inspect")
    try:
        js = nc.jetstream()
        records = await registered_now(js, namespace, component)
        records.sort(key=lambda r: (r.extra.get("replica_id", ""), r.instance_id))
        try:
            stream_last = (await js.stream_info(names.KV_EVENTS_STREAM)).state.last_seq
        except nats.js.errors.NotFoundError:
            stream_last = 0
        return records, stream_last
    finally:
        await nc.close()


async def _status(address: str, call: Callable[[grpc.aio.Channel], Awaitable[Any]]) -> tuple[Any, str | None]:
    """(the instance's status, None) or (None, why it could not be asked)."""
    try:
        async with channel_to(address) as channel:
            return await call(channel), None
    except grpc.aio.AioRpcError as exc:
        return None, f"{exc.code().name}: {exc.details()}"


async def inspect_indexers(nats_url: str, namespace: str, timeout: float) -> list[dict[str, Any]]:
    records, stream_last = await _instances(nats_url, namespace, "indexer")
    rows = []
    for record in records:
        row: dict[str, Any] = {
            "replica_id": record.extra.get("replica_id"),
            "address": record.address,
            "metrics": record.extra.get("metrics"),
        }
        status, error = await _status(
            record.address,
            lambda channel: indexer_pb2_grpc.IndexerStub(channel).GetStatus(
                indexer_pb2.IndexerStatusRequest(), timeout=timeout
            ),
        )
        if error is not None:
            row["error"] = error
        else:
            row.update(
                applied_sequence=status.applied_sequence,
                stream_last_sequence=stream_last,
                lag=status.lag_messages,
                events_applied=status.events_applied,
                gaps=status.gaps,
                recoveries=status.recoveries,
                snapshot_sequence=status.snapshot_sequence,
                workers=[
                    {
                        "worker_id": w.worker_id,
                        "dp_rank": w.dp_rank,
                        "tier": w.tier or "device",
                        "blocks": w.blocks,
                        "last_event_id": w.last_event_id,
                        "recovering": w.recovering,
                    }
                    for w in status.workers
                ],
            )
        rows.append(row)
    return rows


async def inspect_workers(nats_url: str, namespace: str, timeout: float) -> list[dict[str, Any]]:
    records, _ = await _instances(nats_url, namespace, "worker")
    rows = []
    for record in records:
        row: dict[str, Any] = {
            "worker_id": record.instance_id,
            "address": record.address,
            "role": record.role,
            "model": record.model,
            "metrics": record.extra.get("metrics"),
            "engine": record.extra.get("engine"),
            "timing": record.extra.get("timing"),
            "speed_class": record.extra.get(SPEED_CLASS_KEY),
        }
        status, error = await _status(
            record.address,
            lambda channel: worker_pb2_grpc.WorkerStub(channel).GetStatus(
                worker_pb2.WorkerStatusRequest(), timeout=timeout
            ),
        )
        if error is not None:
            row["error"] = error
        else:
            row.update(
                cached_blocks=status.cached_blocks,
                active_blocks=status.active_blocks,
                total_blocks=status.total_blocks,
                running=status.running_requests,
                waiting=status.waiting_requests,
            )
        rows.append(row)
    return rows


async def inspect_routers(nats_url: str, namespace: str, timeout: float) -> list[dict[str, Any]]:
    records, _ = await _instances(nats_url, namespace, "router")
    rows = []
    for record in records:
        row: dict[str, Any] = {
            "router_id": record.instance_id,
            "address": record.address,
            "metrics": record.extra.get("metrics"),
            "mode": record.extra.get("mode"),
        }
        status, error = await _status(
            record.address,
            lambda channel: router_pb2_grpc.RouterStub(channel).GetStatus(
                router_pb2.RouterStatusRequest(), timeout=timeout
            ),
        )
        if error is not None:
            row["error"] = error
        else:
            row.update(
                replica_sync=status.replica_sync,
                sync_peers=status.sync_peers,
                active_requests=status.active_requests,
                workers=[
                    {
                        "worker_id": load.worker_id,
                        "dp_rank": load.dp_rank,
                        "active_prefill_tokens": load.active_prefill_tokens,
                        "active_decode_blocks": load.active_decode_blocks,
                    }
                    for load in status.loads
                ],
                outcome_window_seconds=status.outcome_window_seconds,
                recent_outcomes=dict(status.recent_outcomes),
                total_outcomes=dict(status.total_outcomes),
                migrations=status.migrations,
                queued=dict(status.queued),
                misconfigurations=list(status.misconfigurations),
                sessions=status.sessions,
                recent_sessions=[
                    {
                        "session_id": s.session_id,
                        "worker_id": s.worker_id,
                        "dp_rank": s.dp_rank,
                        "expires_in_s": round(s.expires_in_s, 1),
                    }
                    for s in status.recent_sessions
                ],
            )
        rows.append(row)
    return rows


def render_routers(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no router replica is registered"

    def counts(outcomes: dict[str, int]) -> str:
        return ", ".join(f"{n} {name}" for name, n in sorted(outcomes.items())) or "none"

    lines = []
    for row in rows:
        where = f"router {row['router_id']} at {row['address']} (metrics http://{row['metrics']}/metrics)"
        if "error" in row:
            lines.append(f"{where}: unreachable ({row['error']})")
            continue
        sync = f"replica sync with {row['sync_peers']} peer(s)" if row["replica_sync"] else "no replica sync"
        waiting = sum(row["queued"].values())
        queue = f", {waiting} waiting in the queue ({counts(row['queued'])})" if waiting else ""
        lines.append(f"{where}: mode {row['mode']}, {sync}, {row['active_requests']} request(s) in flight{queue}")
        for w in row["workers"]:
            lines.append(
                f"    worker {w['worker_id']} rank {w['dp_rank']}: predicted {w['active_prefill_tokens']} prefill "
                f"tokens, {w['active_decode_blocks']} active blocks"
            )
        lines.append(
            f"    last {row['outcome_window_seconds']} s: {counts(row['recent_outcomes'])}; "
            f"since start: {counts(row['total_outcomes'])}; {row['migrations']} migration(s)"
        )
        if row["sessions"]:
            lines.append(f"    {row['sessions']} session(s) with an affinity; the latest routed:")
            lines.extend(
                f"      {s['session_id']} -> worker {s['worker_id']} rank {s['dp_rank']} "
                f"(for {s['expires_in_s']:g} s more)"
                for s in row["recent_sessions"]
            )
        lines.extend(f"    MISCONFIGURED: {problem}" for problem in row["misconfigurations"])
    return "\n".join(lines)


def render_indexers(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no indexer replica is registered"
    lines = []
    for row in rows:
        if "error" in row:
            lines.append(f"replica {row['replica_id']} at {row['address']}: unreachable ({row['error']})")
            continue
        lines.append(
            f"replica {row['replica_id']} at {row['address']}: applied {row['applied_sequence']} of "
            f"{row['stream_last_sequence']} (lag {row['lag']}), gaps {row['gaps']}, recoveries {row['recoveries']}, "
            f"snapshot at {row['snapshot_sequence']}"
        )
        for w in row["workers"]:
            flag = "  (recovering)" if w["recovering"] else ""
            lines.append(
                f"    worker {w['worker_id']} rank {w['dp_rank']}"
                f"{'' if w['tier'] == 'device' else ' ' + w['tier']}: {w['blocks']} blocks, "
                f"last event {w['last_event_id']}{flag}"
            )
    return "\n".join(lines)


def render_workers(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no worker is registered"
    lines = []
    for row in rows:
        if "error" in row:
            lines.append(f"worker {row['worker_id']} at {row['address']}: unreachable ({row['error']})")
            continue
        lines.append(
            f"worker {row['worker_id']} at {row['address']} ({row['role']}, {row['model']}): "
            f"{row['cached_blocks']} cached blocks, {row['active_blocks']} active of {row['total_blocks']}, "
            f"{row['running']} running, {row['waiting']} waiting"
        )
        timing = row.get("timing")
        if timing:
            model = from_constants(timing)
            lines.append(
                f"    fitted step time ({row.get('engine') or 'engine'}): prefill ms = {model.prefill_a:.3g}·T² + "
                f"{model.prefill_b:.4g}·T + {model.prefill_c:.4g}; decode ms = {model.decode_a:.4g}·u² + "
                f"{model.decode_b:.4g}·u + {model.decode_c:.4g}  (1k-token prefill {model.prefill_ms(1000):.1f} ms)"
            )
        else:
            lines.append("    fitted step time: not yet (no steps measured)")
        if row.get("speed_class"):  # routers cost the workers of one class at one speed (decision 62)
            lines.append(f"    speed class: {row['speed_class']}")
    return "\n".join(lines)


async def inspect_jetstream(nats_url: str, namespace: str, timeout: float) -> list[dict[str, Any]]:
    """Each stream kvmesh keeps (its own, and those behind its buckets): replicas, leader, each
    follower's lag. Shared by every namespace on the server, so ``namespace`` does not narrow it."""
    nc = await connect_nats(nats_url, name="kvmesh-inspect")
    try:
        states = await asyncio.wait_for(kvmesh_streams(nc.jetstream(timeout=timeout)), timeout)
        size = cluster_size(nc)
    except (TimeoutError, nats.errors.Error) as exc:
        raise SystemExit(
            f"JetStream did not answer within {timeout:g} s ({type(exc).__name__}); is a majority of the NATS "
            "cluster's servers up? (--timeout waits longer)"
        ) from None
    finally:
        await nc.close()
    return [{**asdict(state), "current_replicas": state.current_replicas, "cluster_size": size} for state in states]


def render_jetstream(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "kvmesh has no JetStream state on this server yet"
    lines = [f"NATS cluster of {rows[0]['cluster_size']} server(s)"]
    for row in rows:
        health = "" if row["current_replicas"] >= row["replicas"] else "  (UNDER-REPLICATED)"
        lines.append(
            f"{row['stream']}: {row['replicas']} replica(s), {row['current_replicas']} current, leader "
            f"{row['leader'] or '-'}, {row['messages']} message(s), last sequence {row['last_sequence']}{health}"
        )
        for peer in row["peers"]:
            state = "offline" if peer["offline"] else "current" if peer["current"] else "catching up"
            lines.append(
                f"    follower {peer['name']}: {state}, lag {peer['lag']}, last seen {peer['active_s']:.1f} s ago"
            )
    return "\n".join(lines)


INSPECTORS = {
    "indexer": (inspect_indexers, render_indexers),
    "worker": (inspect_workers, render_workers),
    "router": (inspect_routers, render_routers),
    "jetstream": (inspect_jetstream, render_jetstream),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvmesh inspect",
        description=(
            "Show what indexer replicas or workers hold, what each router replica sees (its mode, predicted "
            "load per worker, recent outcomes), found through NATS discovery; or (jetstream) each JetStream "
            "stream and bucket kvmesh keeps: its replicas, leader and each follower's lag."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("what", choices=sorted(INSPECTORS), help="which component to inspect")
    parser.add_argument(
        "--nats-url",
        default=None,
        help="NATS server URL, or several comma-separated (default: $KVMESH_NATS_URL, else that of the running "
        "`kvmesh up` of the namespace, else nats://127.0.0.1:4222)",
    )
    parser.add_argument("--namespace", default=default_namespace(), help="mesh namespace [env KVMESH_NAMESPACE]")
    parser.add_argument(
        "--nats-connect-timeout",
        type=float,
        default=None,
        help="seconds to wait for NATS before giving up (default 5, or $KVMESH_NATS_CONNECT_TIMEOUT); a refused "
        "login fails at once",
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each instance")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    configure_logging("warning", service="inspect")  # results go to stdout, logs to stderr
    if args.nats_connect_timeout is not None:  # the flag overrides the environment's default
        os.environ[NATS_CONNECT_TIMEOUT_ENV] = str(args.nats_connect_timeout)
    nats_url, source = resolve_nats_url(args.nats_url, args.namespace)
    print(f"NATS {nats_url} ({source}), namespace {args.namespace}", file=sys.stderr)
    inspect, render = INSPECTORS[args.what]
    rows = asyncio.run(inspect(nats_url, args.namespace, args.timeout))
    print(json.dumps(rows, indent=2) if args.json else render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
