"""Child processes end with their parent, and starting them is safe beside gRPC's threads."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys

import grpc
import pytest

from kvmesh.common.runtime.child_process import ending_with_parent
from kvmesh.common.runtime.ports import free_port
from tests.support import wait_until

pytestmark = pytest.mark.integration
needs_setpriv = pytest.mark.skipif(shutil.which("setpriv") is None, reason="util-linux's setpriv is not installed")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def command_of(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as comm:
        return comm.read().strip()


@needs_setpriv
def test_a_child_gets_sigterm_when_its_parent_is_killed():
    parent_code = (
        "import subprocess, sys, time\n"
        "from kvmesh.common.runtime.child_process import ending_with_parent\n"
        "child = subprocess.Popen(ending_with_parent(['sleep', '120']), start_new_session=True)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    try:
        # setpriv sets the signal, then execs: once the process is `sleep`, the signal is set
        wait_until(lambda: command_of(child_pid) == "sleep", timeout=10, what="the child running `sleep`")
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        wait_until(lambda: not alive(child_pid), timeout=10, what="the orphaned child ending")
    finally:
        if alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def test_children_start_cleanly_while_grpc_threads_are_busy():
    # Python code run between fork and exec (preexec_fn) crashed about one child in three here
    async def main() -> list[int]:
        port = free_port()

        async def answer(message: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return message

        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler("t.Echo", {"Say": grpc.unary_unary_rpc_method_handler(answer)})
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        stop = asyncio.Event()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            say = channel.unary_unary("/t.Echo/Say")

            async def traffic() -> None:
                while not stop.is_set():
                    await say(b"x")

            callers = [asyncio.create_task(traffic()) for _ in range(4)]

            def start_and_wait() -> int:
                child = subprocess.Popen(ending_with_parent(["true"]), start_new_session=True)
                return child.wait(timeout=30)

            codes = [await asyncio.to_thread(start_and_wait) for _ in range(60)]
            stop.set()
            await asyncio.gather(*callers)
        await server.stop(None)
        return codes

    codes = asyncio.run(main())
    assert codes == [0] * 60
