from kvmesh.router.outcomes import OutcomeWindow


def test_recent_counts_only_the_window_totals_everything():
    now = [0.0]
    window = OutcomeWindow(window_seconds=60, clock=lambda: now[0])
    window.record("completed")
    window.record("resource_exhausted")
    now[0] = 30.0
    window.record("completed")
    assert window.recent() == {"completed": 2, "resource_exhausted": 1}
    now[0] = 61.0
    assert window.recent() == {"completed": 1}
    assert window.totals() == {"completed": 2, "resource_exhausted": 1}
    now[0] = 200.0
    assert window.recent() == {}
