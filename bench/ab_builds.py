"""Two builds of kvmesh on one load, interleaved: is a change faster, or is it the machine?

This machine's speed drifts by up to 20% from one minute to the next (decision 19), more than most
changes to the serving path are worth. Rounds of "start a mesh, load it, stop it" for each build in
turn put that drift between the builds. Here both meshes run at once (the idle one costs little)
and short bursts of the same load alternate between them, the order flipping each burst, so drift
hits both alike; the medians and the per-burst ratios say what the change did.

    python -m bench.ab_builds --base 426c65f                      # the working tree against 426c65f
    python -m bench.ab_builds --base HEAD~3 --head HEAD --c 1 --n 800 --bursts 8
    python -m bench.ab_builds --base HEAD --stream

Each revision is checked out with ``git worktree`` into a temporary folder and run from there with
this checkout's virtual environment (``PYTHONPATH`` puts its ``services`` first as ``kvmesh``), so
a revision whose dependencies differ from the installed ones needs its own environment instead.
Every burst is ``bench.serving_cpu`` against one mesh, counting only that mesh's processes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from bench.peers import wait_for
from kvmesh.up import MeshProcess

REPO = Path(__file__).resolve().parents[1]
FIGURES = ("requests_per_s", "p50_ms", "serving_cpu_ms_per_request")
HELLO = {"role": "user", "content": "hi"}


@contextlib.contextmanager
def build_path(revision: str | None) -> Iterator[dict[str, str]]:
    """The environment that runs ``revision`` (``None``: this working tree) as ``kvmesh``."""
    if revision is None:
        yield {}
        return
    with tempfile.TemporaryDirectory(prefix="kvmesh-ab-") as scratch:
        tree = Path(scratch) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), revision], cwd=REPO, check=True)
        try:
            path = Path(scratch) / "path"
            path.mkdir()
            (path / "kvmesh").symlink_to(tree / "services")
            yield {"PYTHONPATH": str(path)}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)


def burst(mesh: MeshProcess, args: argparse.Namespace, n: int) -> dict:
    """One load on ``mesh``: bench.serving_cpu's figures."""
    command = [sys.executable, "-m", "bench.serving_cpu", "--url", f"{mesh.api}/chat/completions"]
    command += ["--n", str(n), "--c", str(args.c), "--max-tokens", str(args.max_tokens)]
    command += ["--root-pid", str(mesh.process.pid)] + (["--stream"] if args.stream else [])
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # the bench is this tree's
    finished = subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO, env=env)
    return json.loads(finished.stdout.strip().splitlines()[-1])


def summary(name: str, bursts: list[dict]) -> dict:
    figures = {figure: statistics.median(b[figure] for b in bursts) for figure in FIGURES}
    services = sorted({service for b in bursts for service in b["cpu_ms_per_request"]})
    for service in services:
        figures[service] = round(statistics.median(b["cpu_ms_per_request"].get(service, 0.0) for b in bursts), 3)
    return {"build": name, **figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the revision to hold the change against")
    parser.add_argument("--head", help="the revision with the change (default: this working tree)")
    parser.add_argument("--bursts", type=int, default=6, help="bursts per build")
    parser.add_argument("--n", type=int, default=1500, help="requests per burst")
    parser.add_argument("--warmup", type=int, default=500, help="requests each mesh serves before the bursts")
    parser.add_argument("--c", type=int, default=8, help="concurrency")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--speedup", type=float, default=100, help="the mock engines' speed-up ratio")
    parser.add_argument("--stream", action="store_true", help="streamed chat instead of whole answers")
    args = parser.parse_args()

    names = {"base": args.base, "head": args.head or "working tree"}
    results: dict[str, list[dict]] = {"base": [], "head": []}
    with build_path(args.base) as base_env, build_path(args.head) as head_env, contextlib.ExitStack() as stack:
        meshes: dict[str, MeshProcess] = {}
        for name, env in (("base", base_env), ("head", head_env)):
            mesh = MeshProcess(
                "--workers", "2", "--speedup-ratio", str(args.speedup), "--log-level", "warning",
                "--namespace", f"ab-{name}", env=env,
            )  # fmt: skip
            mesh.start(timeout=120)
            stack.callback(mesh.stop)
            wait_for(f"{mesh.api}/chat/completions", {"model": "kvmesh-tiny", "messages": [HELLO]})
            meshes[name] = mesh
        for mesh in meshes.values():
            burst(mesh, args, args.warmup)
        for number in range(args.bursts):
            order = ("base", "head") if number % 2 == 0 else ("head", "base")
            for name in order:
                figures = burst(meshes[name], args, args.n)
                results[name].append(figures)
                print(f"burst {number + 1} {name:4} {json.dumps(figures)}", flush=True)
    print()
    for name in ("base", "head"):
        print(f"{name} ({names[name]}): {json.dumps(summary(name, results[name]))}")
    for figure in FIGURES:
        ratios = [h[figure] / b[figure] for b, h in zip(results["base"], results["head"], strict=True) if b[figure]]
        if ratios:
            print(
                f"head / base {figure}: median {statistics.median(ratios):.3f}, "
                f"range {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} bursts"
            )


if __name__ == "__main__":
    main()
