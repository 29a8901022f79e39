"""NIXL (UCX backend, DRAM) as the KV transfer's fast data plane: one agent per worker with the
worker's whole KV buffer registered; the decode side READs the prefill worker's slots directly."""

from __future__ import annotations

import contextlib
import threading
import time
import types
from typing import Any

from kvmesh.worker.kv_transfer.kv_buffer import KvBuffer, contiguous_runs
from kvmesh.worker.kv_transfer.messages import TransferError

# How long NIXL's progress thread waits between polls when nothing moves (µs). NIXL's Python API
# fixes it at 0, and the thread then spins a whole core per worker even while idle (two prefill and
# decode workers starved a 2-core machine). The thread cannot simply be left out: the prefill side of
# a read is passive and UCX needs it to progress (connection set-up, TCP's emulated reads). A reader
# still polls its own transfer without waiting, so a read is not slowed.
PROGRESS_POLL_US = 1000
_AGENT_CREATION = threading.Lock()


def nixl_available() -> bool:
    try:
        import nixl._api  # noqa: F401
    except Exception:  # not installed, or its native libraries cannot load
        return False
    return True


class NixlAgent:
    """One NIXL agent per worker with the worker's whole KV buffer registered as DRAM (UCX backend).

    NIXL calls block, so they run in a thread; the lock keeps one transfer at a time per agent."""

    def __init__(self, name: str, kv: KvBuffer) -> None:
        self.name = name
        self.kv = kv
        self._agent = _agent_with_idle_progress_thread(name)
        self._agent.register_memory([(kv.address, kv.size, 0, "")], mem_type="DRAM")
        self.metadata: bytes = self._agent.get_agent_metadata()
        self._remotes: set[str] = set()
        self._lock = threading.Lock()

    def read(
        self,
        remote_name: str,
        remote_metadata: bytes,
        remote_address: int,
        remote_slots: list[int],
        local_slots: list[int],
        deadline: float,
    ) -> None:
        """READ the remote slots into the local ones (same block size), blocking until done."""
        size = self.kv.block_bytes
        local, remote = [], []
        for start_local, start_remote, count in contiguous_runs(local_slots, remote_slots):
            local.append((self.kv.address + start_local * size, count * size, 0))
            remote.append((remote_address + start_remote * size, count * size, 0))
        with self._lock:
            if remote_name not in self._remotes:
                self._agent.add_remote_agent(remote_metadata)
                self._remotes.add(remote_name)
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(local, mem_type="DRAM"),
                self._agent.get_xfer_descs(remote, mem_type="DRAM"),
                remote_name,
            )
            try:
                state = self._agent.transfer(handle)
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise TransferError("NIXL read timed out")
                    time.sleep(0.0002)
                    state = self._agent.check_xfer_state(handle)
                if state != "DONE":
                    raise TransferError(f"NIXL read ended in state {state}")
            except Exception:
                # the peer may be gone: forget it, so a retry starts from its fresh metadata
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(remote_name)
                self._remotes.discard(remote_name)
                raise
            finally:
                with contextlib.suppress(Exception):
                    self._agent.release_xfer_handle(handle)


def _agent_with_idle_progress_thread(name: str) -> Any:
    """A NIXL agent (UCX) whose progress thread waits ``PROGRESS_POLL_US`` between idle polls.

    ``nixl_agent`` sets the native config's delay to 0 just before creating the native agent, so
    the native constructor it calls is swapped, for this one call, for one that sets the delay first.
    A NIXL without that layout gets its defaults (a spinning thread) rather than an error."""
    from nixl import _api

    bindings = _api.nixlBind
    native_agent = getattr(bindings, "nixlAgent", None)
    if native_agent is None:
        return _api.nixl_agent(name, _api.nixl_agent_config(backends=["UCX"]))

    def create(agent_name: str, config: Any) -> Any:
        config.pthrDelay = PROGRESS_POLL_US
        return native_agent(agent_name, config)

    with _AGENT_CREATION:
        _api.nixlBind = types.SimpleNamespace(**{**vars(bindings), "nixlAgent": create})
        try:
            return _api.nixl_agent(name, _api.nixl_agent_config(backends=["UCX"]))
        finally:
            _api.nixlBind = bindings
