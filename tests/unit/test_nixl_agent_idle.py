"""kvmesh's NIXL agent keeps NIXL's progress thread (the passive side of a read needs it) but makes it
wait between idle polls instead of spinning a core."""

from __future__ import annotations

import types

import numpy as np
import pytest

from kvmesh.worker.kv_transfer import nixl_agent

pytestmark = pytest.mark.skipif(not nixl_agent.nixl_available(), reason="NIXL is not installed (the nixl extra)")


class HostBuffer:
    def __init__(self) -> None:
        self.array = np.zeros(1 << 16, dtype=np.uint8)
        self.address = self.array.ctypes.data
        self.size = self.array.nbytes
        self.block_bytes = 4096


def test_the_native_agent_is_created_with_a_poll_delay_and_nixl_is_left_as_it_was(monkeypatch):
    from nixl import _api

    real = _api.nixlBind
    seen = []

    def recording_agent(name, config):
        seen.append((name, config.pthrDelay, config.useProgThread))
        return real.nixlAgent(name, config)

    monkeypatch.setattr(_api, "nixlBind", types.SimpleNamespace(**{**vars(real), "nixlAgent": recording_agent}))
    patched = _api.nixlBind
    agent = nixl_agent.NixlAgent("idle-test", HostBuffer())
    assert seen == [("idle-test", nixl_agent.PROGRESS_POLL_US, True)]
    assert _api.nixlBind is patched  # swapped for the one call only
    assert agent.metadata  # a working agent: it describes itself for peers
