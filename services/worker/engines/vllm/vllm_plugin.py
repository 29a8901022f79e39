"""kvmesh's vLLM plugin (entry point ``vllm.general_plugins``): vLLM loads it in each of its processes,
the engine core and model workers included, which kvmesh cannot reach otherwise.

It does one thing, and only for engines a kvmesh worker started (the worker sets
:data:`QUIET_NIXL_ENV`; any other vLLM in the same environment is left alone): vLLM's NIXL connector
creates its NIXL agent with NIXL's progress thread, and NIXL's Python API starts that thread with no
delay between polls, so it spins a whole core even when nothing moves. Two prefill/decode workers on
a 2-core machine left nothing for the engines themselves: NIXL handshakes timed out, discovery leases
expired and a 300-token prefill took 27 s instead of 0.5 s. The connector needs no such thread: it
checks its transfers and notifications on every engine step, and those calls move UCX forward.

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
from typing import Any

QUIET_NIXL_ENV = "KVMESH_VLLM_NIXL_NO_PROGRESS_THREAD"
_CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"

log = logging.getLogger(__name__)


def register() -> None:
    """vLLM's plugin hook: called before any connector is created."""
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
