import math

import msgpack
import pytest

from kvmesh.common.wire.frontend_load import LoadReport, LoadReportError
from kvmesh.frontend.load_window import LoadWindow


def test_a_window_reports_each_arrival_and_finished_request_once():
    now = [100.0]
    window = LoadWindow("frontend-a", clock=lambda: now[0])
    window.arrived()
    window.arrived()
    window.finished(input_tokens=1000, output_tokens=11, cached_tokens=256, ttft_s=0.2, decode_s=0.5)
    window.finished(input_tokens=10, output_tokens=1, cached_tokens=0, ttft_s=0.1, decode_s=0.0)
    now[0] = 105.0
    report = LoadReport.decode(window.drain().encode())
    assert (report.source, report.start_s, report.end_s, report.arrivals) == ("frontend-a", 100.0, 105.0, 2)
    first, single = report.samples
    assert first.ttft_ms == pytest.approx(200) and first.itl_ms == pytest.approx(50)  # 0.5 s over 10 gaps
    assert math.isnan(single.itl_ms)
    empty = window.drain()
    assert empty.arrivals == 0 and empty.samples == () and empty.start_s == 105.0


@pytest.mark.parametrize("data", [b"not msgpack at all \xc1", msgpack.packb([99, "x", 0, 1, 0, []]), msgpack.packb(1)])
def test_anything_else_on_the_subject_is_refused(data):
    with pytest.raises(LoadReportError):
        LoadReport.decode(data)
