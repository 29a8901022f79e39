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


def test_cache_replies_sends_each_turn_after_the_last_and_finds_its_reply_cached(kv_mesh, tmp_path):
    """Two sessions of three turns, each turn's context its predecessor's, then that turn's reply
    (600 output tokens: two 512-token trace blocks; 300: one), then a new message. With
    --cache-replies every later turn starts after its predecessor's answer, and the worker it is
    routed to holds its context through the reply, not only the previous prompt."""
    block = 64
    rows = []
    for s, base in (("a", 100), ("b", 200)):
        turns = [([base, base + 1], 600), ([base, base + 1, base + 2, base + 3, base + 4], 300)]
        turns.append(([*turns[1][0], base + 5, base + 6], 8))
        for t, (ids, output) in enumerate(turns):
            # 1 ms apart: each turn is due before its predecessor can have been answered
            row = {"timestamp": t, "input_length": len(ids) * block, "output_length": output, "hash_ids": ids}
            rows.append({**row, "session_id": s})
    rows.sort(key=lambda r: r["timestamp"])
    trace = tmp_path / "sessions.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "replies-run"
    options = ["--trace", str(trace), "--trace-block-size", str(block), "--max-output-tokens", "4"]
    code = cli.main(["--url", kv_mesh.api, *options, "--cache-replies", "--output-dir", str(out), "--no-progress"])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["completed"] == 6
    assert report["cached_replies"] == {"wanted": 4, "cached": 4, "failed": 0, "unplaced": 0, "error_examples": []}
    by_index = {r["index"]: r for r in report["per_request"]}
    for index, row in enumerate(rows):
        earlier = [i for i in range(index) if rows[i]["session_id"] == row["session_id"]]
        if not earlier:
            continue
        previous, turn = by_index[earlier[-1]], by_index[index]
        assert turn["sent_s"] >= previous["sent_s"] + previous["e2e_s"], "a turn went before its predecessor's answer"
        through_reply = len(rows[earlier[-1]]["hash_ids"]) + (2 if rows[earlier[-1]]["output_length"] > 512 else 1)
        assert turn["cached_tokens"] >= through_reply * block, (index, turn["cached_tokens"])


def test_bench_rejects_conflicting_pacing(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--concurrency", "2", "--request-rate", "3"])
    assert "not both" in capsys.readouterr().err
