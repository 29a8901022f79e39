"""The request path's reports: the reports a frontend sends the router that routed its request, and
what the router does with them (docs/decisions/0023)."""

from __future__ import annotations

import msgpack
import pytest

from kvmesh.common.wire.request_reports import (
    END,
    FIRST_TOKEN,
    RequestReport,
    decode_reports,
    encode_reports,
    without_superseded,
)
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.report_listener import MIGRATED, ReportListener
from tests.unit.test_disagg_planning import router as make_router
from tests.unit.test_disagg_planning import worker


def test_reports_round_trip_in_one_message():
    reports = [
        RequestReport(FIRST_TOKEN, "a"),
        RequestReport(END, "a", "completed", 12),
        RequestReport(END, "b:m1", MIGRATED, 3, failed_worker_id=2**63 + 5),
        RequestReport(FIRST_TOKEN, "c", kv_source=b"\x81\xa4kind\xa9kv_source"),
    ]
    assert decode_reports(encode_reports(reports)) == reports


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        msgpack.packb({"kind": "end", "request_id": "a"}),  # a map, not a list
        msgpack.packb([{"kind": "free", "request_id": "a"}]),  # an unknown kind
        msgpack.packb([{"kind": "end", "request_id": ""}]),  # no request
        msgpack.packb([{"kind": "end"}]),
        msgpack.packb([{"kind": "first_token", "request_id": "a", "kv_source": 5}]),  # not bytes
    ],
)
def test_a_malformed_message_is_refused_whole(payload):
    with pytest.raises(ValueError, match=r"request report|msgpack"):
        decode_reports(payload)


def listening_router():
    router = make_router({1: "aggregated", 2: "aggregated"})
    metrics = RouterMetrics(router.loads.pictures, lambda: 0)
    return router, metrics, ReportListener(router, metrics)


def prefill_tokens(router, worker_id: int) -> int:
    return next(w.active_prefill_tokens for w in router.load_by_worker() if w.worker_id == worker_id)


def test_reports_do_what_the_relay_would_do_to_the_load_picture():
    router, metrics, listener = listening_router()
    router.track_add("r", worker(1, "aggregated"), [11, 12, 13], 48, 0, 0)
    assert prefill_tokens(router, 1) == 48

    listener.apply(RequestReport(FIRST_TOKEN, "r"))
    assert prefill_tokens(router, 1) == 0 and "r" in router.loads

    listener.apply(RequestReport(END, "r", MIGRATED, 5, failed_worker_id=1))
    assert "r" not in router.loads
    assert 1 in router.failed.avoiding(router.clock())
    assert metrics.migrations_total == 1

    router.track_add("r:m1", worker(2, "aggregated"), [11, 12, 13], 53, 0, 0)
    listener.apply(RequestReport(END, "r:m1", "completed", 7))
    assert "r:m1" not in router.loads and 2 not in router.failed.avoiding(router.clock())
    assert metrics.outcomes.totals() == {"completed": 1}
    assert listener.applied == 3


def test_a_report_for_a_request_not_held_changes_no_load_but_still_counts():
    router, metrics, listener = listening_router()
    router.track_add("kept", worker(1, "aggregated"), [11], 16, 0, 0)
    # e.g. a request its departed worker took with it: the migration and the broken worker still count
    for report in (RequestReport(FIRST_TOKEN, "gone"), RequestReport(END, "gone", MIGRATED, failed_worker_id=2)):
        listener.apply(report)
    assert "kept" in router.loads and prefill_tokens(router, 1) == 16
    assert 2 in router.failed.avoiding(router.clock()) and metrics.migrations_total == 1
    assert listener.applied == 0


def test_a_message_of_reports_is_applied_whole_and_a_malformed_one_not_at_all():
    router, _, listener = listening_router()
    router.track_add("a", worker(1, "aggregated"), [11], 16, 0, 0)
    router.track_add("b", worker(2, "aggregated"), [12], 16, 0, 0)
    listener.apply_message(msgpack.packb([{"kind": "end", "request_id": "a"}, {"kind": "free", "request_id": "b"}]))
    assert "a" in router.loads and "b" in router.loads and listener.applied == 0  # one bad report spoils all
    listener.apply_message(encode_reports([RequestReport(END, "a", "completed", 1), RequestReport(END, "b")]))
    assert "a" not in router.loads and "b" not in router.loads and listener.applied == 2


def test_a_first_token_report_travelling_with_its_requests_end_is_left_out():
    reports = [
        RequestReport(FIRST_TOKEN, "a"),
        RequestReport(FIRST_TOKEN, "b"),
        RequestReport(END, "a", "completed", 8),
        RequestReport(END, "c", "completed", 3),
    ]
    assert without_superseded(reports) == [reports[1], reports[2], reports[3]]
    only_first = [RequestReport(FIRST_TOKEN, "a")]
    assert without_superseded(only_first) == only_first
    # what the router makes of the shorter list is what it made of the whole one
    whole, short = listening_router(), listening_router()
    for router, _, _ in (whole, short):
        router.track_add("a", worker(1, "aggregated"), [11, 12], 32, 0, 0)
        router.track_add("b", worker(1, "aggregated"), [21, 22], 32, 0, 0)
    whole[2].apply_message(encode_reports(reports))
    short[2].apply_message(encode_reports(without_superseded(reports)))
    assert [r in router.loads for r in ("a", "b") for router in (whole[0], short[0])] == [False, False, True, True]
    assert prefill_tokens(whole[0], 1) == prefill_tokens(short[0], 1) == 0
    assert whole[1].outcomes.totals() == short[1].outcomes.totals() == {"completed": 2}


def test_a_first_token_report_with_a_kv_source_stays_beside_its_end():
    # the router counts where a split request's KV came from from the first-token report alone
    with_source = RequestReport(FIRST_TOKEN, "a", kv_source=b"source")
    ended = RequestReport(END, "a", "completed", 2)
    assert without_superseded([with_source, ended]) == [with_source, ended]
