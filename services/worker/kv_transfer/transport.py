"""KV transfer between workers: a prefill worker serves the KV blocks it holds, a decode worker pulls
them into its own KV buffer.

Control plane: one TCP connection per pull, length-prefixed msgpack frames. The decode worker asks
for a *room* (the rendezvous id the router chose); the prefill worker waits until that room's
prefill has finished (the decode worker may arrive first, on the bootstrap path), answers with the
slots holding the requested blocks, and the bytes move on one of two data planes:

- ``nixl``: the decode worker READs the slots straight out of the prefill worker's registered
  buffer with NIXL (UCX backend, DRAM), using the agent metadata from the answer;
- ``tcp``: the prefill worker writes the slots' bytes on the same connection.

The decode worker checks every received block against the bytes it would have computed, then says
``done``; the prefill worker then releases the held blocks (or after ``hold_timeout_s`` if nobody
comes or the decode worker dies).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import structlog

from kvmesh.worker.kv_transfer.kv_buffer import KvBuffer
from kvmesh.worker.kv_transfer.messages import (
    PullDone,
    PullGranted,
    PullRefused,
    PullRequest,
    TransferError,
    answer_from_frame,
)
from kvmesh.worker.kv_transfer.nixl_agent import NixlAgent

log = structlog.get_logger(__name__)

_LENGTH = struct.Struct("<I")
MAX_FRAME = 64 << 20


# ---- frames: a little-endian u32 length, then a msgpack map --------------------------------------
def _encode_frame(message: dict) -> bytes:
    body = msgpack.packb(message)
    return _LENGTH.pack(len(body)) + body


def _frame_length(header: bytes) -> int:
    (length,) = _LENGTH.unpack(header)
    if length > MAX_FRAME:
        raise TransferError(f"frame of {length} bytes is too large")
    return length


def _decode_frame(body: bytes) -> dict:
    message = msgpack.unpackb(body)
    if not isinstance(message, dict):
        raise TransferError("frame is not a map")
    return message


async def write_frame(writer: asyncio.StreamWriter, message: dict) -> None:
    writer.write(_encode_frame(message))
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader) -> dict:
    length = _frame_length(await reader.readexactly(_LENGTH.size))
    return _decode_frame(await reader.readexactly(length))


async def _sock_recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> None:
    while view:
        received = await loop.sock_recv_into(sock, view)
        if received == 0:
            raise TransferError("the prefill worker closed the connection mid-transfer")
        view = view[received:]


async def _sock_read_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> dict:
    header = bytearray(_LENGTH.size)
    await _sock_recv_exactly(loop, sock, memoryview(header))
    body = bytearray(_frame_length(bytes(header)))
    await _sock_recv_exactly(loop, sock, memoryview(body))
    return _decode_frame(bytes(body))


async def _sock_write_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, message: dict) -> None:
    await loop.sock_sendall(sock, _encode_frame(message))


# ---- counters shared by both ends --------------------------------------------------------------
@dataclass
class TransferStats:
    """What moved, for the worker's metrics. Keys are backend names."""

    bytes_sent: dict[str, int] = field(default_factory=dict)
    bytes_received: dict[str, int] = field(default_factory=dict)
    pulls: dict[str, int] = field(default_factory=dict)  # outcome -> count
    in_flight: int = 0  # pulls moving bytes now (not those still waiting for their prefill)
    pull_seconds: dict[str, float] = field(default_factory=dict)  # time received pulls took, by backend

    def count(self, table: dict[str, Any], key: str, amount: float = 1) -> None:
        table[key] = table.get(key, 0) + amount


# ---- prefill side -----------------------------------------------------------------------------
@dataclass
class _Room:
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    request_id: str | None = None
    slots: list[int] | None = None
    cached_tokens: int = 0
    error: str | None = None
    expires: asyncio.TimerHandle | None = None
    waiting: int = 0  # pulls that arrived before the prefill finished


class KvTransferServer:
    """Serves held KV blocks by room. Guarantees: a room's blocks are released exactly once — when a
    decode worker reports them received, when the hold times out, or when the server stops."""

    def __init__(
        self,
        kv: KvBuffer,
        release: Callable[[str], object],
        hold_timeout_s: float,
        nixl: NixlAgent | None,
        stats: TransferStats | None = None,
    ) -> None:
        self.kv = kv
        self._release = release
        self.hold_timeout_s = hold_timeout_s
        self.nixl = nixl
        self.backend = "nixl" if nixl is not None else "tcp"
        self.stats = stats or TransferStats()
        self._rooms: dict[int, _Room] = {}
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int = 0) -> int:
        self._server = await asyncio.start_server(self._serve, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        for room in list(self._rooms):
            self._drop(room)

    def _room(self, room: int) -> _Room:
        entry = self._rooms.get(room)
        if entry is None:
            entry = self._rooms[room] = _Room()
        return entry

    def held_rooms(self) -> int:
        return sum(1 for r in self._rooms.values() if r.slots is not None)

    def pulls_waiting(self, room: int) -> int:
        """Pulls waiting at the rendezvous for ``room`` (arrived before its prefill finished)."""
        entry = self._rooms.get(room)
        return entry.waiting if entry is not None else 0

    def ready(self, room: int, request_id: str, slots: list[int], cached_tokens: int = 0) -> None:
        """The prefill for ``room`` finished; its blocks are held in ``slots`` until released.
        ``cached_tokens``: prompt tokens the prefill found cached, passed on to the decode worker."""
        entry = self._room(room)
        entry.request_id, entry.slots, entry.cached_tokens = request_id, slots, cached_tokens
        entry.expires = asyncio.get_running_loop().call_later(self.hold_timeout_s, self._expire, room)
        entry.ready.set()

    def fail(self, room: int, reason: str) -> None:
        """The prefill for ``room`` will never be ready; a waiting decode worker is told why."""
        entry = self._room(room)
        entry.error = reason
        entry.ready.set()
        asyncio.get_running_loop().call_later(self.hold_timeout_s, self._rooms.pop, room, None)

    def _expire(self, room: int) -> None:
        log.warning("KV held for a transfer nobody completed; releasing", room=room)
        self._drop(room)

    def _drop(self, room: int) -> None:
        entry = self._rooms.pop(room, None)
        if entry is None:
            return
        if entry.expires is not None:
            entry.expires.cancel()
        if entry.request_id is not None and entry.slots is not None:
            self._release(entry.request_id)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        room = None
        moving = False
        try:
            ask = PullRequest.from_frame(await read_frame(reader))
            room = ask.room
            entry = self._room(room)
            entry.waiting += 1
            try:
                await asyncio.wait_for(entry.ready.wait(), ask.wait_s)
            except TimeoutError:
                await write_frame(writer, PullRefused(f"room {room} was not ready in time").to_frame())
                return
            finally:
                entry.waiting -= 1
            if entry.error is not None or entry.slots is None:
                await write_frame(writer, PullRefused(entry.error or "room failed", retry=False).to_frame())
                return
            first, count = ask.first_block, ask.num_blocks
            if ask.block_bytes != self.kv.block_bytes or first < 0 or first + count > len(entry.slots):
                refusal = PullRefused(
                    f"asked for blocks {first}..{first + count} of {len(entry.slots)} "
                    f"at {ask.block_bytes} bytes each; this worker holds {self.kv.block_bytes}",
                    retry=False,
                )
                await write_frame(writer, refusal.to_frame())
                return
            slots = entry.slots[first : first + count]
            if self.nixl is not None and ask.backend == "nixl":
                answer = PullGranted(
                    "nixl", slots, self.nixl.name, self.nixl.metadata, self.kv.address, entry.cached_tokens
                )
            else:
                answer = PullGranted("tcp", slots, cached_tokens=entry.cached_tokens)
            # counted from here: a pull waiting at the rendezvous is not moving bytes yet
            moving = True
            self.stats.in_flight += 1
            await write_frame(writer, answer.to_frame())
            if answer.backend == "tcp":
                for slot in slots:
                    writer.write(self.kv.region(slot))
                await writer.drain()
            done = PullDone.from_frame(await read_frame(reader))
            backend = answer.backend
            if done.received:
                self.stats.count(self.stats.bytes_sent, backend, count * self.kv.block_bytes)
                self._drop(room)
        except (asyncio.IncompleteReadError, ConnectionError, TransferError, KeyError, ValueError) as exc:
            log.warning("KV pull ended early", room=room, error=str(exc) or type(exc).__name__)
        finally:
            if moving:
                self.stats.in_flight -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def _recv_exactly_blocking(sock: socket.socket, view: memoryview) -> None:
    while view:
        received = sock.recv_into(view)
        if received == 0:
            raise TransferError("the prefill worker closed the connection mid-transfer")
        view = view[received:]


# ---- decode side ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PullResult:
    backend: str
    bytes: int
    seconds: float
    prefill_cached_tokens: int = 0  # prompt tokens the prefill worker had cached


class KvTransferClient:
    """Pulls a room's blocks into this worker's buffer and verifies them."""

    def __init__(self, kv: KvBuffer, nixl: NixlAgent | None, stats: TransferStats | None = None) -> None:
        self.kv = kv
        self.nixl = nixl
        self.backend = "nixl" if nixl is not None else "tcp"
        self.stats = stats or TransferStats()

    async def pull(
        self,
        host: str,
        port: int,
        room: int,
        first_block: int,
        slots: list[int],
        contents: list[int],
        timeout_s: float,
        verify: bool = True,
    ) -> PullResult:
        """Blocks ``first_block`` … of the room into ``slots``; each must then hold what ``contents``
        (the blocks' sequence hashes) says — checked unless ``verify`` is False (the bandwidth
        benchmark measures the move alone). Raises :class:`TransferError`."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        sock: socket.socket | None = None
        moving = False
        try:
            async with asyncio.timeout(timeout_s):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await loop.sock_connect(sock, (host, port))
                ask = PullRequest(
                    room, first_block, len(slots), self.kv.block_bytes, self.backend, max(0.0, timeout_s - 0.5)
                )
                await _sock_write_frame(loop, sock, ask.to_frame())
                answer = answer_from_frame(await _sock_read_frame(loop, sock))
                if isinstance(answer, PullRefused):
                    raise TransferError(answer.error, retryable=answer.retry)
                if len(answer.slots) != len(slots):
                    raise TransferError("the prefill worker answered with a different number of blocks")
                moving = True
                self.stats.in_flight += 1
                backend = answer.backend
                if backend == "nixl":
                    if self.nixl is None:
                        raise TransferError("the prefill worker chose NIXL, which this worker lacks")
                    await asyncio.to_thread(
                        self.nixl.read, answer.agent, answer.metadata, answer.address, answer.slots, slots, deadline
                    )
                else:
                    # a blocking receive in a thread: no event-loop round trip per 64 KiB chunk, and
                    # the GIL is free while the kernel copies
                    await asyncio.to_thread(self._receive_blocks, sock, slots, deadline)
                # checked off the event loop: a long prompt's check takes milliseconds
                bad = await asyncio.to_thread(self.kv.count_mismatches, slots, contents) if verify else 0
                if bad:
                    raise TransferError(f"{bad} of {len(slots)} received blocks do not hold the expected KV")
                await _sock_write_frame(loop, sock, PullDone().to_frame())
        except TimeoutError:
            self.stats.count(self.stats.pulls, "failed")
            raise TransferError(f"KV transfer from {host}:{port} timed out after {timeout_s}s") from None
        except OSError as exc:
            self.stats.count(self.stats.pulls, "failed")
            raise TransferError(f"KV transfer from {host}:{port} failed: {exc}") from None
        except TransferError:
            self.stats.count(self.stats.pulls, "failed")
            raise
        finally:
            if moving:
                self.stats.in_flight -= 1
            if sock is not None:
                sock.close()
        size = len(slots) * self.kv.block_bytes
        self.stats.count(self.stats.pulls, "ok")
        self.stats.count(self.stats.bytes_received, backend, size)
        seconds = time.perf_counter() - started
        self.stats.count(self.stats.pull_seconds, backend, seconds)
        return PullResult(backend, size, seconds, answer.cached_tokens)

    def _receive_blocks(self, sock: socket.socket, slots: list[int], deadline: float) -> None:
        sock.setblocking(True)
        try:
            for slot in slots:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                _recv_exactly_blocking(sock, self.kv.region(slot))
        except TimeoutError:
            raise TransferError("KV transfer timed out mid-transfer") from None
        finally:
            sock.setblocking(False)
