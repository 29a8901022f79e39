"""Where a running ``kvmesh up`` is: its NATS URL, namespace and API, recorded for the other tools.

``kvmesh up`` writes one file per user and namespace once the mesh is ready and removes it when it
stops; ``kvmesh inspect``, ``kvmesh bench``, ``kvmesh planner`` and the client read it, so they work
next to a running mesh without flags. A file left by a mesh that died (its process is gone) is ignored.

The folder is ``$KVMESH_RUN_DIR``, else ``$XDG_RUNTIME_DIR/kvmesh``, else ``<tmp>/kvmesh-<uid>``.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from kvmesh.common.wire import names

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


@dataclass(frozen=True)
class RunRecord:
    """One running ``kvmesh up``."""

    nats_url: str
    namespace: str
    api: str  # the OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1
    pid: int
    planner_state_db: str | None = None  # with --planner: where its steps are recorded


def run_dir() -> Path:
    explicit = os.environ.get("KVMESH_RUN_DIR")
    if explicit:
        return Path(explicit)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "kvmesh"
    return Path(tempfile.gettempdir()) / f"kvmesh-{os.getuid()}"


def run_file(namespace: str) -> Path:
    return run_dir() / f"{namespace}.json"


def write_run_record(record: RunRecord) -> Path:
    """Record a ready mesh (atomically: a reader never sees half a file)."""
    path = run_file(record.namespace)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    partial = path.with_suffix(f".{record.pid}.tmp")
    partial.write_text(json.dumps(asdict(record)))
    partial.replace(path)
    return path


def remove_run_record(namespace: str, pid: int) -> None:
    """Remove the record if it is still this process's (a newer mesh may have replaced it)."""
    record = read_run_record(namespace, require_alive=False)
    if record is not None and record.pid == pid:
        with contextlib.suppress(FileNotFoundError):
            run_file(namespace).unlink()


def read_run_record(namespace: str, require_alive: bool = True) -> RunRecord | None:
    """The running mesh of ``namespace``, or None (no file, an unreadable one, or a dead mesh's)."""
    try:
        record = RunRecord(**json.loads(run_file(namespace).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    if require_alive and not _alive(record.pid):
        return None
    return record


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def resolve_nats_url(explicit: str | None, namespace: str | None = None) -> tuple[str, str]:
    """The NATS URL a tool should use, and where it came from: the flag, ``KVMESH_NATS_URL``, the
    running ``kvmesh up`` of the namespace, or the default."""
    if explicit:
        return explicit, "--nats-url"
    from_env = os.environ.get("KVMESH_NATS_URL")
    if from_env:
        return from_env, "KVMESH_NATS_URL"
    namespace = namespace or default_namespace()
    record = read_run_record(namespace)
    if record is not None:
        return record.nats_url, f"kvmesh up (pid {record.pid}, {run_file(namespace)})"
    return DEFAULT_NATS_URL, "default"


def default_namespace() -> str:
    return os.environ.get("KVMESH_NAMESPACE") or names.DEFAULT_NAMESPACE
