"""The JSON report of a ``kvmesh bench`` run and its PNG plots (matplotlib, no display needed)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvmesh.loadgen.runner import RequestResult
from kvmesh.loadgen.workload import BenchRequest, PrefixCheck
from kvmesh.replay.report import percentile


def _distribution(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {
        "mean": sum(values) / len(values) * 1000,
        "p50": percentile(values, 50) * 1000,
        "p90": percentile(values, 90) * 1000,
        "p99": percentile(values, 99) * 1000,
    }


def _refusals(results: Sequence[RequestResult]) -> dict[str, Any]:
    """Refused requests by HTTP status, and whether each status came with Retry-After."""
    statuses: dict[str, Any] = {}
    for r in results:
        if r.status is not None:
            entry = statuses.setdefault(str(r.status), {"count": 0, "with_retry_after": 0})
            entry["count"] += 1
            entry["with_retry_after"] += r.retry_after is not None
    return statuses


def _by_priority(results: Sequence[RequestResult]) -> dict[str, Any]:
    """With priority classes sent: per class, the requests, their refusals and TTFT."""
    classes = sorted({r.priority for r in results if r.priority})
    if not classes:
        return {}
    summary = {}
    for priority in classes:
        mine = [r for r in results if r.priority == priority]
        ok = [r for r in mine if r.error is None]
        summary[priority] = {
            "requests": len(mine),
            "completed": len(ok),
            "refusals": _refusals(mine),
            "ttft_ms": _distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        }
    return {"by_priority": summary}


def build_report(
    label: str, settings: dict[str, Any], results: Sequence[RequestResult], prefix_check: PrefixCheck | None
) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    duration = max((r.done_s for r in ok if r.done_s is not None), default=0.0)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    errors = [r.error for r in results if r.error]
    return {
        "label": label,
        "settings": settings,
        "requests": len(results),
        "completed": len(ok),
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:5],
        "duration_s": duration,
        "request_throughput_per_s": len(ok) / duration if duration else 0.0,
        "output_tokens_per_s": output_tokens / duration if duration else 0.0,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "cached_tokens": cached,
        "cached_token_ratio": cached / prompt_tokens if prompt_tokens else 0.0,
        "ttft_ms": _distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": _distribution([gap for r in ok for gap in r.inter_token_s]),
        "e2e_ms": _distribution([r.e2e_s for r in ok if r.e2e_s is not None]),
        "refusals": _refusals(results),
        **_by_priority(results),
        "prefix_check": None
        if prefix_check is None
        else {
            "checked": prefix_check.checked,
            "mismatched": prefix_check.mismatched,
            "first_mismatch": prefix_check.first_mismatch,
        },
        "per_request": [
            {
                "index": r.index,
                "sent_s": r.sent_s,
                "ttft_s": r.ttft_s,
                "e2e_s": r.e2e_s,
                "output_tokens": r.output_tokens,
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "worker_id": r.worker_id,
                "chunk_times_s": r.chunk_times_s,
                "error": r.error,
            }
            for r in results
        ],
    }


def reply_summary(
    requests: Sequence[BenchRequest], results: Sequence[RequestResult], replies: Sequence[RequestResult]
) -> dict[str, Any]:
    """What became of the replies ``--cache-replies`` prefills: ``wanted`` (turns a later turn
    continues, with reply blocks), ``cached``, ``failed``, and ``unplaced`` (answered, but by an
    endpoint that named no worker). A turn that itself failed has no reply to cache."""
    wanted = {r.index for r in requests if r.reply_prompt}
    unplaced = [r for r in results if r.index in wanted and r.error is None and r.worker_id is None]
    failed = [r.error for r in replies if r.error is not None]
    return {
        "wanted": len(wanted),
        "cached": len(replies) - len(failed),
        "failed": len(failed),
        "unplaced": len(unplaced),
        "error_examples": sorted(set(failed))[:5],
    }


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, values_ms: Sequence[float], label: str) -> None:
    ordered = sorted(values_ms)
    if ordered:
        ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)


def _samples(report: dict[str, Any]) -> dict[str, list[float]]:
    rows = [r for r in report["per_request"] if r["error"] is None]
    itl = [(b - a) * 1000 for r in rows for a, b in zip(r["chunk_times_s"], r["chunk_times_s"][1:], strict=False)]
    return {
        "TTFT": [r["ttft_s"] * 1000 for r in rows if r["ttft_s"] is not None],
        "ITL": itl,
        "end to end": [r["e2e_s"] * 1000 for r in rows if r["e2e_s"] is not None],
    }


def plot_latency_cdfs(reports: Sequence[dict[str, Any]], path: Path) -> None:
    """One panel per latency (TTFT, ITL, end to end), one line per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for report in reports:
        for ax, (name, values) in zip(axes, _samples(report).items(), strict=True):
            _cdf(ax, values, report["label"])
            ax.set_title(f"{name} CDF")
            ax.set_xlabel("ms")
            ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of token gaps")
            ax.grid(True, alpha=0.3)
    for ax in axes:
        if ax.get_lines():
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_timeline(report: dict[str, Any], path: Path, bucket_s: float | None = None) -> None:
    """Output tokens per second and each request's TTFT against time since the start.

    The throughput bucket defaults to a sixtieth of the run (at least 50 ms), so short and long runs
    both draw a curve.
    """
    plt = _pyplot()
    rows = [r for r in report["per_request"] if r["error"] is None]
    if bucket_s is None:
        bucket_s = max(0.05, report.get("duration_s", 0.0) / 60)
    buckets: dict[int, float] = {}
    for r in rows:
        chunks = r["chunk_times_s"]
        per_chunk = r["output_tokens"] / len(chunks) if chunks else 0.0
        for t in chunks:
            key = math.floor(t / bucket_s)
            buckets[key] = buckets.get(key, 0.0) + per_chunk
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    if buckets:
        keys = range(min(buckets), max(buckets) + 1)
        top.plot([k * bucket_s for k in keys], [buckets.get(k, 0.0) / bucket_s for k in keys], marker=".")
    top.set_ylabel("output tokens / s")
    top.set_title(f"throughput over time — {report['label']}")
    top.grid(True, alpha=0.3)
    bottom.scatter(
        [r["sent_s"] for r in rows if r["ttft_s"] is not None],
        [r["ttft_s"] * 1000 for r in rows if r["ttft_s"] is not None],
        s=6,
    )
    bottom.set_xlabel("seconds since start")
    bottom.set_ylabel("TTFT ms")
    bottom.set_title("TTFT over time (by send time)")
    bottom.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(report: dict[str, Any], output_dir: Path) -> list[Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = [output_dir / "report.json", output_dir / "latency_cdf.png", output_dir / "timeline.png"]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    plot_latency_cdfs([report], paths[1])
    plot_timeline(report, paths[2])
    return paths


def compare(report_paths: Sequence[Path], output: Path) -> None:
    reports = [json.loads(p.read_text()) for p in report_paths]
    plot_latency_cdfs(reports, output)
