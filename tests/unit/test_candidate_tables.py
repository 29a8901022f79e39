"""The tables a decision derives from its candidate records, shared between decisions over the same
records and rebuilt when a record changes (kvmesh.router.candidates.CandidateTables)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvmesh.common.runtime.discovery import InstanceRecord
from kvmesh.common.runtime.misconfiguration import Findings
from kvmesh.common.wire.disagg import MOVES_BLOCKS_KEY
from kvmesh.common.wire.worker_key import DATA_PARALLEL_KEY, WorkerKey
from kvmesh.router.candidates import Candidates, RouteInput
from kvmesh.router.eligibility import FailedWorkers
from kvmesh.router.fleet_checks import FleetChecks


class Directory:
    """Registered workers, replaced whole on each registration as discovery's watcher does."""

    def __init__(self) -> None:
        self.records: dict[int, InstanceRecord] = {}

    def register(self, worker_id: int, **extra: object) -> None:
        self.records[worker_id] = InstanceRecord("worker", worker_id, "", model="m", block_size=16, extra=dict(extra))

    def instances(self) -> list[InstanceRecord]:
        return list(self.records.values())

    def get(self, instance_id: int) -> InstanceRecord | None:
        return self.records.get(instance_id)


def candidates(directory: Directory) -> Candidates:
    checks = FleetChecks(Findings(CollectorRegistry()), True, lambda: 0.0)
    return Candidates(directory, FailedWorkers(5.0), checks, lambda: 0.0)


REQUEST = RouteInput("m", list(range(40)))


def test_decisions_over_the_same_records_share_one_set_of_tables():
    directory = Directory()
    for worker_id in (1, 2, 3):
        directory.register(worker_id)
    stage = candidates(directory)
    first, second = stage.whole_request(REQUEST), stage.whole_request(REQUEST)
    assert first.tables is second.tables
    assert first.keys == (WorkerKey(1, 0), WorkerKey(2, 0), WorkerKey(3, 0))
    assert first.by_id[2] is directory.records[2]
    assert first.tables.pullable == frozenset()


def test_a_worker_that_registers_again_is_read_afresh():
    directory = Directory()
    for worker_id in (1, 2):
        directory.register(worker_id)
    stage = candidates(directory)
    before = stage.whole_request(REQUEST)
    # worker 2 comes back with two data-parallel ranks and an engine that moves blocks
    directory.register(2, **{DATA_PARALLEL_KEY: 2, MOVES_BLOCKS_KEY: True})
    after = stage.whole_request(REQUEST)
    assert after.tables is not before.tables
    assert after.keys == (WorkerKey(1, 0), WorkerKey(2, 0), WorkerKey(2, 1))
    assert after.tables.pullable == frozenset({WorkerKey(2, 0)})
    assert after.by_id[2] is directory.records[2]
    assert before.keys == (WorkerKey(1, 0), WorkerKey(2, 0))  # a decision under way keeps what it read


def test_a_worker_that_leaves_or_is_avoided_is_no_candidate_in_the_tables():
    directory = Directory()
    for worker_id in (1, 2, 3):
        directory.register(worker_id)
    stage = candidates(directory)
    stage.whole_request(REQUEST)
    del directory.records[3]
    assert stage.whole_request(REQUEST).keys == (WorkerKey(1, 0), WorkerKey(2, 0))
    stage.failed.mark(1, now=0.0)
    prepared = stage.whole_request(REQUEST)
    assert prepared.keys == (WorkerKey(2, 0),) and set(prepared.by_id) == {2}
