"""A whole mesh started the way a user starts it: ``kvmesh up`` as a separate process tree."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvmesh.common.runtime.ports import process_tree
from kvmesh.common.wire.requests import WORKER_ID_HEADER
from kvmesh.devtools.mesh_process import MeshProcess
from tests.support import wait_until


def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (read from /proc), ``pid`` itself left out."""
    return process_tree(pid) - {pid}


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def start_mesh(*extra: str) -> Iterator[MeshProcess]:
    mesh = MeshProcess("--speedup-ratio", "50", "--log-level", "warning", *extra).start()
    assert mesh.process is not None
    children = descendants(mesh.process.pid)
    try:
        assert len(children) >= 6  # nats, indexer, router, 2 workers, frontend
        yield mesh
    finally:
        children = descendants(mesh.process.pid) or children
        code = mesh.stop()
    assert code == 0, "kvmesh up did not stop cleanly:\n" + "".join(mesh.output[-50:])
    wait_until(lambda: not any(_alive(pid) for pid in children), timeout=10, what="no orphan processes")


@pytest.fixture(scope="module")
def kv_mesh() -> Iterator[MeshProcess]:
    """A KV-routing mesh."""
    yield from start_mesh("--router-mode", "kv")


@pytest.fixture(scope="module")
def round_robin_mesh() -> Iterator[MeshProcess]:
    yield from start_mesh("--router-mode", "round-robin")


def chat(mesh: MeshProcess, content: str, **kwargs) -> tuple[openai.types.chat.ChatCompletion, int]:
    """One chat completion through the mesh's HTTP API with the openai client, and the worker that served it."""
    client = openai.OpenAI(base_url=mesh.api, api_key="unused", max_retries=0, timeout=30)
    raw = client.chat.completions.with_raw_response.create(
        model="kvmesh-tiny", messages=[{"role": "user", "content": content}], **kwargs
    )
    return raw.parse(), int(raw.headers[WORKER_ID_HEADER])
