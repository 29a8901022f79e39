"""A frozen startup heap leaves the garbage collector's view; what is made afterwards does not."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest

from kvmesh.common.runtime import heap
from kvmesh.common.runtime.heap import freeze_startup_heap


@pytest.fixture
def service_process(monkeypatch: pytest.MonkeyPatch):
    """This test process, taken for a service's own for the test (the flag is put back after)."""
    monkeypatch.setattr(heap, "_process_is_the_service", False)
    heap.own_process_heap()
    yield
    gc.unfreeze()


def tracked_ids() -> set[int]:
    return {id(o) for o in gc.get_objects()}


# Run in a fresh interpreter: walking the collector's view of this test process's heap, grown by the
# whole suite, took 20 s; a fresh one holds a few thousand objects.
ALIVE_AT_THE_FREEZE = """
import gc
from kvmesh.common.runtime import heap
def tracked_ids():
    return {id(o) for o in gc.get_objects()}
heap.own_process_heap()
startup = [[n] for n in range(50)]  # lists are tracked by the collector
assert all(id(x) in tracked_ids() for x in startup)
frozen = heap.freeze_startup_heap()
assert frozen >= len(startup), frozen
tracked = tracked_ids()
assert not any(id(x) in tracked for x in startup), "frozen objects still walked"
later = [[1], [2]]
tracked = tracked_ids()
assert all(id(x) in tracked for x in later), "objects made after the freeze not walked"
print("checked")
"""


def test_objects_alive_at_the_freeze_are_no_longer_walked() -> None:
    done = subprocess.run([sys.executable, "-c", ALIVE_AT_THE_FREEZE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "checked"  # after the freeze's log line


def test_garbage_at_the_freeze_is_collected_first(service_process: None) -> None:
    class Node:
        pass

    cycle = Node()
    cycle.self = cycle  # type: ignore[attr-defined]
    gone = weakref.ref(cycle)
    del cycle
    assert freeze_startup_heap() > 0
    # collected before the freeze, not frozen with the rest (frozen objects are never freed)
    assert gone() is None


def test_a_service_started_inside_another_program_leaves_its_heap_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_process_is_the_service", False)
    kept = [[1]]
    assert freeze_startup_heap() == 0
    assert gc.get_freeze_count() == 0 and id(kept[0]) in tracked_ids()
