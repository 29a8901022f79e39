"""Keep what a service built while starting out of the garbage collector's full collections.

A started service holds a large heap that lives as long as the process: imported modules, the
tokenizer, FastAPI's and gRPC's objects, the engine. CPython's full (generation 2) collection walks
all of it each time, and under load the survivors of short-lived work (pieces of prompt remembered,
the samples a frontend publishes every few seconds) trigger one every second or so. Measured under
load: the frontend's loop stopped for 40–46 ms every 0.7–0.8 s, a worker's for 38–57 ms, and every
request in flight waited that long (docs/decisions/0028).

Only a service's own process freezes its heap: :func:`kvmesh.common.runtime.service.service_main` (what
``kvmesh <service>`` and ``python -m kvmesh.<service>`` run) says so with :func:`own_process_heap`.
A service started inside another program (the tests, an embedding application) leaves that
program's heap alone, as a library should.
"""

from __future__ import annotations

import gc

import structlog

log = structlog.get_logger(__name__)

_process_is_the_service = False


def own_process_heap() -> None:
    """This process runs one kvmesh service and nothing else: it may freeze its heap once started."""
    global _process_is_the_service
    _process_is_the_service = True


def freeze_startup_heap() -> int:
    """Where the process is the service's own (:func:`own_process_heap`): collect once, then move
    every object alive now into the collector's permanent generation, which its collections never
    walk. Returns how many objects were frozen (0 elsewhere).

    Call it once, when the service has started. What is frozen is never collected: an object among
    them that becomes cyclic garbage later stays, which suits the long-lived heap of a started
    service. Objects made afterwards are collected as usual."""
    if not _process_is_the_service:
        return 0
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze the startup heap", objects=frozen)
    return frozen
