"""A CPU quota for one process and its children: a cgroup of its own with a CFS quota (cgroup v2's
``cpu.max``, or v1's ``cpu.cfs_quota_us``), so a benchmark can saturate one service while what
drives it has the rest of the machine. Needs root (or a delegated cgroup)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


class CpuQuotaError(RuntimeError):
    """No cgroup CPU controller can be written here (not root, or none mounted)."""


class CpuQuota:
    """``with CpuQuota(name, cores) as quota: quota.add(pid)``: the processes added get at most
    ``cores`` of CPU time (a fraction of one core is fine); removed on exit."""

    def __init__(self, name: str, cores: float) -> None:
        if cores <= 0:
            raise ValueError("a CPU quota must be positive")
        self.cores = cores
        if (ROOT / "cgroup.controllers").is_file() and "cpu" in (ROOT / "cgroup.controllers").read_text().split():
            self.version, self.path = 2, ROOT / name
        elif (ROOT / "cpu" / "cpu.cfs_quota_us").is_file():
            self.version, self.path = 1, ROOT / "cpu" / name
        else:
            raise CpuQuotaError(f"no cgroup CPU controller under {ROOT}")

    def __enter__(self) -> CpuQuota:
        quota_us = round(self.cores * PERIOD_US)
        try:
            self.path.mkdir()
            if self.version == 2:
                (self.path / "cpu.max").write_text(f"{quota_us} {PERIOD_US}")
            else:
                (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (self.path / "cpu.cfs_quota_us").write_text(str(quota_us))
        except OSError as exc:
            with contextlib.suppress(OSError):
                self.path.rmdir()
            raise CpuQuotaError(f"cannot make the cgroup {self.path} (root needed): {exc}") from exc
        return self

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def throttled(self) -> int:
        """Periods in which the quota stopped the processes so far."""
        for line in (self.path / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "nr_throttled":
                return int(value)
        return 0

    def __exit__(self, *exc: object) -> None:
        # the processes go back to the parent group before the group can be removed
        parent = self.path.parent / "cgroup.procs"
        with contextlib.suppress(OSError):
            for pid in (self.path / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    parent.write_text(pid)
        with contextlib.suppress(OSError):
            self.path.rmdir()
        if self.path.exists():
            print(f"note: the cgroup {self.path} is left behind (processes still in it: pid {os.getpid()} ran it)")
