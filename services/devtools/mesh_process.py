"""``kvmesh up`` as a child process, for tests and benchmarks (a developer tool, not a service)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time


class MeshProcess:
    """``kvmesh up`` as a child process, for tests and benchmarks: start it, wait for its banner,
    read where it listens, stop it with SIGTERM."""

    def __init__(self, *args: str, http_port: int | None = None, env: dict[str, str] | None = None) -> None:
        """``env``: variables set for it on top of this process's environment."""
        from kvmesh.common.runtime.ports import free_port

        self.http_port = http_port or free_port()
        self.env = env or {}
        self.argv = [sys.executable, "-m", "kvmesh", "up", "--http-port", str(self.http_port), *args]
        self.output: list[str] = []
        self.process: subprocess.Popen[str] | None = None
        self.nats_url = ""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def api(self) -> str:
        return f"{self.base_url}/v1"

    def start(self, timeout: float = 60.0) -> MeshProcess:
        import os
        import re
        import threading

        self.process = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **self.env, "PYTHONUNBUFFERED": "1"},
        )
        stdout = self.process.stdout
        threading.Thread(target=lambda: self.output.extend(iter(stdout.readline, "")), daemon=True).start()
        deadline = time.monotonic() + timeout
        while not any("kvmesh is up" in line for line in self.output):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("kvmesh up did not start:\n" + "".join(self.output[-40:]))
            time.sleep(0.05)
        match = next(m for line in self.output if (m := re.search(r"NATS: (\S+)", line)))
        self.nats_url = match.group(1)
        return self

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM ``kvmesh up`` and return its exit code (it stops its children first)."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)
