"""``kvmesh inspect indexer|worker``: what each replica or worker holds, found through discovery."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import nats.js.errors

from kvmesh.common import names
from kvmesh.common.discovery import DiscoveryWatcher
from kvmesh.common.grpc_server import insecure_channel
from kvmesh.common.proto.kvmesh.v1 import indexer_pb2, indexer_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh.common.runtime import connect_nats
from kvmesh.common.structured_logging import configure_logging
from kvmesh.common.timing import from_constants


async def _instances(nats_url: str, namespace: str, component: str):
    nc = await connect_nats(nats_url, name="kvmesh-inspect")
    try:
        js = nc.jetstream()
        watcher = DiscoveryWatcher(js, namespace, component)
        await watcher.start()
        records = sorted(watcher.instances(), key=lambda r: (r.extra.get("replica_id", ""), r.instance_id))
        await watcher.stop()
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
        async with insecure_channel(address) as channel:
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
                lag=max(0, stream_last - status.applied_sequence),
                events_applied=status.events_applied,
                gaps=status.gaps,
                recoveries=status.recoveries,
                snapshot_sequence=status.snapshot_sequence,
                workers=[
                    {
                        "worker_id": w.worker_id,
                        "dp_rank": w.dp_rank,
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
                f"    worker {w['worker_id']} rank {w['dp_rank']}: {w['blocks']} blocks, "
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
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvmesh inspect",
        description="Show what indexer replicas or workers hold; instances are found through NATS discovery.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("what", choices=("indexer", "worker"), help="which component to inspect")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222", help="NATS server URL")
    parser.add_argument("--namespace", default=names.DEFAULT_NAMESPACE, help="mesh namespace")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each instance")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    configure_logging("warning", service="inspect")  # results go to stdout, logs to stderr
    inspect = inspect_indexers if args.what == "indexer" else inspect_workers
    rows = asyncio.run(inspect(args.nats_url, args.namespace, args.timeout))
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(render_indexers(rows) if args.what == "indexer" else render_workers(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
