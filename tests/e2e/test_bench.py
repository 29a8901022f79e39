"""``kvmesh bench`` against a running ``kvmesh up`` produces a well-formed report and plots."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvmesh.inspector import inspect_routers
from kvmesh.loadgen import cli
from tests.support import discovered

pytestmark = pytest.mark.e2e
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bench_synthetic_run_writes_report_and_plots(kv_mesh, tmp_path):
    out = tmp_path / "run"
    code = cli.main(
        [
            "--url",
            kv_mesh.api,
            "--num-requests",
            "30",
            "--num-prefixes",
            "2",
            "--prefix-tokens",
            "256",
            "--suffix-tokens",
            "16",
            "--output-tokens",
            "8",
            "--concurrency",
            "4",
            "--output-dir",
            str(out),
            "--no-progress",
            "--label",
            "kvmesh-kv",
        ]
    )
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["completed"] == 30 and report["errors"] == 0
    assert report["output_tokens"] == 30 * 8
    assert report["prefix_check"] == {"checked": 30, "mismatched": 0, "first_mismatch": None}
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        stats = report[key]
        assert 0 <= stats["p50"] <= stats["p99"], key
    # two shared 256-token prefixes: after the first of each, KV routing serves most from cache
    assert report["cached_token_ratio"] > 0.5
    assert report["output_tokens_per_s"] > 0 and len(report["per_request"]) == 30
    # each request names the worker that served it, one of the mesh's
    served_by = {row["worker_id"] for row in report["per_request"]}
    assert None not in served_by and served_by <= {str(r.instance_id) for r in discovered(kv_mesh.nats_url, "worker")}
    for name in ("latency_cdf.png", "timeline.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC

    assert (
        cli.main(["--compare", str(out / "report.json"), str(out / "report.json"), "--output-dir", str(tmp_path)]) == 0
    )
    assert (tmp_path / "compare_cdf.png").read_bytes()[:8] == PNG_MAGIC


def test_bench_trace_mode_at_a_fixed_rate(kv_mesh, tmp_path):
    """A trace replayed at a fixed rate; a session-structured trace's session ids reach the router."""
    trace = tmp_path / "trace.jsonl"
    shape = {"input_length": 100, "output_length": 3}
    rows = [{"timestamp": i * 100, **shape, "hash_ids": [0, i % 2], "session_id": f"s{i % 2}"} for i in range(8)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "trace-run"
    code = cli.main(
        [
            "--url",
            kv_mesh.api,
            "--trace",
            str(trace),
            "--trace-block-size",
            "64",
            "--request-rate",
            "20",
            "--output-dir",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["completed"] == 8 and report["prompt_tokens"] == 8 * 100
    assert report["cached_tokens"] > 0  # hash id 0 is shared by every request
    (router,) = asyncio.run(inspect_routers(kv_mesh.nats_url, "default", timeout=5))
    assert {"s0", "s1"} <= {s["session_id"] for s in router["recent_sessions"]}


def test_bench_rejects_conflicting_pacing(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--concurrency", "2", "--request-rate", "3"])
    assert "not both" in capsys.readouterr().err
