"""A service's own process freezes its startup heap once ready (docs/decisions/0028)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import pytest

pytestmark = pytest.mark.integration


async def test_a_service_process_freezes_its_startup_heap_once_ready(nats_url: str):
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvmesh.indexer", "--nats-url", nats_url, "--log-level", "info",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},  # each log line as it is written
    )  # fmt: skip
    seen: list[str] = []
    try:

        async def frozen_count() -> int:
            assert process.stdout is not None
            while line := (await process.stdout.readline()).decode():
                seen.append(line)
                record = json.loads(line) if line.startswith("{") else {}  # JSON logs when piped
                if record.get("event") == "froze the startup heap":
                    return int(record["objects"])
            raise AssertionError("the indexer ended without freezing its heap:\n" + "".join(seen))

        objects = await asyncio.wait_for(frozen_count(), 60)
        assert objects > 10_000  # modules, gRPC, NATS: the heap of a started service
        assert any('"indexer ready"' in line for line in seen)  # frozen once ready, not before
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), 30)
