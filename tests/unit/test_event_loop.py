"""Services run on uvloop unless KVMESH_EVENT_LOOP asks for the standard loop (decision 20)."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from kvmesh.common.runtime.process import event_loop_kind, run_until_signalled


def loop_of_a_service() -> type:
    seen: list[type] = []

    async def serve(stop: asyncio.Event) -> None:
        seen.append(type(asyncio.get_running_loop()))

    run_until_signalled(serve)
    return seen[0]


def test_a_service_runs_on_uvloop_by_default(monkeypatch):
    monkeypatch.delenv("KVMESH_EVENT_LOOP", raising=False)
    assert event_loop_kind() == "uvloop"
    assert loop_of_a_service() is uvloop.Loop


def test_the_standard_loop_can_be_asked_for(monkeypatch):
    monkeypatch.setenv("KVMESH_EVENT_LOOP", "asyncio")
    assert loop_of_a_service() is not uvloop.Loop


def test_an_unknown_loop_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("KVMESH_EVENT_LOOP", "trio")
    with pytest.raises(SystemExit, match="KVMESH_EVENT_LOOP must be uvloop or asyncio"):
        event_loop_kind()
