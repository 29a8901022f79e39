"""Every NATS name kvmesh uses, in one place (DESIGN §3, §4, §5, §6)."""

from __future__ import annotations

import re

KV_EVENTS_STREAM = "KVMESH_KV_EVENTS"
INSTANCES_BUCKET = "KVMESH_INSTANCES"
INDEX_SNAPSHOTS_BUCKET = "KVMESH_INDEX_SNAPSHOTS"
LOCKS_BUCKET = "KVMESH_LOCKS"  # the snapshot lock (one indexer replica snapshots at a time)
PLANNER_LEASE_BUCKET = "KVMESH_PLANNER_LEASE"  # one planner acts at a time
PLANNER_STEPS_STREAM = "KVMESH_PLANNER_STEPS"  # the planners' shared memory (--state-store nats)


def kv_stream(bucket: str) -> str:
    """The stream that holds a KV bucket (JetStream's naming)."""
    return f"KV_{bucket}"


def object_stream(bucket: str) -> str:
    """The stream that holds an object store (JetStream's naming)."""
    return f"OBJ_{bucket}"


def jetstream_streams() -> list[str]:
    """Every JetStream stream kvmesh keeps: its own and those that hold its buckets and object store."""
    return [
        KV_EVENTS_STREAM,
        kv_stream(INSTANCES_BUCKET),
        object_stream(INDEX_SNAPSHOTS_BUCKET),
        kv_stream(LOCKS_BUCKET),
        kv_stream(PLANNER_LEASE_BUCKET),
        PLANNER_STEPS_STREAM,
    ]


DEFAULT_NAMESPACE = "default"


def kv_events_subject(namespace: str, worker_id: int | str) -> str:
    """Subject a worker publishes its KV events on."""
    return f"kvmesh.{namespace}.kv.{worker_id}"


def kv_events_wildcard(namespace: str) -> str:
    """Subject filter covering every worker's KV events in a namespace."""
    return f"kvmesh.{namespace}.kv.*"


def router_sync_subject(namespace: str) -> str:
    return f"kvmesh.{namespace}.router.sync"


def load_report_subject(namespace: str) -> str:
    """Frontends publish what they served each few seconds here; the planner listens."""
    return f"kvmesh.{namespace}.metrics.frontend"


def router_load_subject(namespace: str) -> str:
    """Routers publish each worker's predicted load each few seconds here; the planner listens."""
    return f"kvmesh.{namespace}.metrics.router"


def planner_scale_subject(namespace: str) -> str:
    """The planner asks the ``kvmesh up`` supervisor (local connector) to resize the worker pool."""
    return f"kvmesh.{namespace}.planner.scale"


def planner_steps_subject(namespace: str) -> str:
    """The acting planner records each step here (``--state-store nats``); a standby reads them back."""
    return f"kvmesh.{namespace}.planner.steps"


def instance_key(namespace: str, component: str, instance_id: int | str) -> str:
    """Key of one instance's record in the discovery bucket."""
    return f"{namespace}.{component}.{instance_id}"


def watcher_probe_key(namespace: str, token: str) -> str:
    """A discovery watcher's own key, written to check that the bucket commits writes (no instance)."""
    return f"{namespace}.watchers.{token}"


def instance_key_prefix(namespace: str, component: str) -> str:
    return f"{namespace}.{component}."


# A namespace names subjects, keys and durable consumers, so it holds no subject separator ('.'),
# wildcard or space: letters, digits, '-' and '_'.
NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")


def namespace_problem(namespace: str) -> str | None:
    """Why ``namespace`` cannot name a mesh, or None when it can."""
    if NAMESPACE_PATTERN.fullmatch(namespace) is None:
        return f"namespace {namespace!r} must be 1 to 64 letters, digits, '-' or '_'"
    return None


def indexer_durable_name(namespace: str, replica_id: str) -> str:
    """The durable consumer of one indexer replica. It names the namespace: replicas of two
    namespaces on one NATS (both `0` by default) must not share a durable, whose subject filter is
    its first owner's namespace."""
    return f"indexer-{namespace}-{replica_id}"


def legacy_indexer_durable_name(replica_id: str) -> str:
    """The durable name before it named the namespace (a replica migrates from it on start)."""
    return f"indexer-{replica_id}"


def kv_event_msg_id(worker_id: int, dp_rank: int, first_event_id: int, tier: str = "device") -> str:
    """JetStream de-duplication id of a batch: a retried publish is stored once. Each storage tier of
    an engine instance numbers its own events, so its ids name the tier (the device's do not, as
    they never did)."""
    if tier == "device":
        return f"{worker_id}:{dp_rank}:{first_event_id}"
    return f"{worker_id}:{dp_rank}:{tier}:{first_event_id}"
