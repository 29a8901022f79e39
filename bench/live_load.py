"""One live load run against a mesh: ``kvmesh bench`` in its own process, its report read back."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run_load(api: str, label: str, *options: str, out_dir: Path | None = None) -> dict:
    """Run ``kvmesh bench --url api`` with ``options`` (workload, rate or concurrency) and return its
    ``report.json`` (TTFT, ITL, throughput, cached tokens); ``out_dir``: keep the report and plots
    there (default: a temporary directory)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(out_dir or tmp)
        command = [sys.executable, "-m", "kvmesh", "bench", "--url", api, "--output-dir", out, "--label", label]
        subprocess.run([*command, "--no-progress", *options], check=True, stdout=subprocess.DEVNULL)
        return json.loads((Path(out) / "report.json").read_text())
