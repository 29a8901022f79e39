"""kvmesh's vLLM plugin (entry point ``vllm.general_plugins``): vLLM loads it in each of its processes,
the engine core and model workers included, which kvmesh cannot reach otherwise. It changes two ways
in which vLLM spins a core, and only for engines a kvmesh worker started with the variable named
(any other vLLM in the same environment is left alone).

**No busy loop where engines share cores** (:data:`NAP_ENV`, set by ``kvmesh up`` for unbound CPU
engines: :func:`~kvmesh.worker.engines.vllm.vllm_defaults.cpu_threads`). The engine core hands each
step to its model worker process over a shared-memory queue, and a reader of that queue (the worker
waiting for a step, the core waiting for its answer) polls it in a loop of ``sched_yield`` for a
second after its last message. Three engines sharing two cores (the live bench's) then spent most
of the machine on those loops: 133 of 146 CPU-seconds in a 73 s window, of which the model's own
steps needed a fraction, and steps of 5 ms took 0.2–1.5 s while a spinning neighbour held the core
(docs/perf, vLLM routing, 2026-12-03). Here the loop sleeps :data:`NAP_S` instead of yielding, so a
waiting reader gives its core away and answers within a fraction of a millisecond. Turning the loop
off altogether is not an option: the queue's wake-up signal can be lost once the loop has ended,
and the reader then waits for its 5 s recheck (TTFT p50 3.8 s when tried).

**No NIXL progress thread** (:data:`QUIET_NIXL_ENV`). vLLM's NIXL connector creates its NIXL agent
with NIXL's progress thread, and NIXL's Python API starts that thread with no delay between polls,
so it spins a whole core even when nothing moves. Two prefill/decode workers on a 2-core machine
left nothing for the engines themselves: NIXL handshakes timed out, discovery leases expired and a
300-token prefill took 27 s instead of 0.5 s. The connector needs no such thread: it checks its
transfers and notifications on every engine step, and those calls move UCX forward.

Without that thread NIXL makes its UCX worker for one thread at a time (it makes it thread-safe only
for a progress thread or for ``NIXL_THREAD_SYNC_RW``), and its agent does not serialise calls unless
asked to. vLLM's connector calls the agent from two threads, though: the engine's (transfers,
notifications) and its handshake thread (a new peer's metadata and endpoints). Now and then a
decode's pull then never finished: the handshake completed, no KV came, and the prefill side let the
blocks go 40 s later (1 test run in 11 here). So the agent is also asked to serialise every call
(``NIXL_THREAD_SYNC_STRICT``), which is what a single-thread UCX worker needs.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import time
from typing import Any

QUIET_NIXL_ENV = "KVMESH_VLLM_NIXL_NO_PROGRESS_THREAD"
NAP_ENV = "KVMESH_VLLM_NO_BUSY_LOOP"
_SHM_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
# a waiting queue reader's sleep: a step handed over waits at most this long more than it did spinning
NAP_S = 0.0002
_CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"

log = logging.getLogger(__name__)


def register() -> None:
    """vLLM's plugin hook: called in every vLLM process before its queues and connector are created."""
    if os.environ.get(NAP_ENV) == "1":
        _nap_in_queues()
    if os.environ.get(QUIET_NIXL_ENV) != "1":
        return
    try:
        connector = importlib.import_module(_CONNECTOR_MODULE)
    except ImportError as exc:  # another vLLM layout: its agent keeps its progress thread
        log.warning("kvmesh could not reach vLLM's NIXL connector (%s); NIXL keeps its progress thread", exc)
        return
    original = getattr(connector, "nixl_agent_config", None)
    if original is None or getattr(original, "_kvmesh_quiet", False):
        return  # NIXL is not installed, or this process patched it already
    sync_modes = getattr(importlib.import_module(original.__module__), "nixl_thread_sync_t", None)
    if sync_modes is None:
        log.warning("kvmesh found no NIXL thread sync modes; NIXL keeps its progress thread")
        return
    connector.nixl_agent_config = without_progress_thread(original, sync_modes.NIXL_THREAD_SYNC_STRICT)


def without_progress_thread(make_config: Any, serialised: Any) -> Any:
    """``make_config`` (NIXL's ``nixl_agent_config``) with the progress thread off and, unless the
    caller chose a sync mode, ``serialised`` (the mode in which the agent serialises its calls)."""

    @functools.wraps(make_config)
    def quiet(*args: Any, **kwargs: Any) -> Any:
        kwargs["enable_prog_thread"] = False
        kwargs.setdefault("sync_mode", serialised)
        return make_config(*args, **kwargs)

    quiet._kvmesh_quiet = True  # type: ignore[attr-defined]
    return quiet


def _nap_in_queues() -> None:
    """vLLM's shared-memory queues wait by sleeping :data:`NAP_S` where they would yield the core."""
    try:
        queues = importlib.import_module(_SHM_MODULE)
    except ImportError as exc:  # another vLLM layout: its queues keep their busy loop
        log.warning("kvmesh could not reach vLLM's shared-memory queue (%s); it keeps its busy loop", exc)
        return
    if not hasattr(queues, "sched_yield"):
        log.warning("vLLM's shared-memory queue waits another way; it keeps its busy loop")
        return
    queues.sched_yield = nap


def nap() -> None:
    """What a waiting reader does in place of ``sched_yield``: sleep, so the core goes to others."""
    time.sleep(NAP_S)
