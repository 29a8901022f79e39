"""A pooled KV memory tier on one host: a directory of shared-memory segments (``/dev/shm``).

Every worker started with ``--kv-pool DIR`` owns one segment file in ``DIR`` and writes the KV
blocks it computes there (write-through); it reads every segment in ``DIR``. A block in the pool
can be brought into any of those workers' own caches with a memory copy instead of a prefill: a
request that moves to another worker (its first worker died, or a decode worker picks up a
prefill) resumes from the pool. A segment outlives its writer (a killed worker's blocks stay
readable) until the pool directory is removed. Layout and concurrency: docs/decisions/0018.

A segment::

    header (64 bytes)  magic "KVMPOOL1", version, block bytes, slots, writer id
    entries            one (sequence hash, checksum, state) triple of u64 per slot
    blocks             one region of ``block_bytes`` per slot, 64-byte aligned

A block lives in one of ``PROBE_SLOTS`` slots after ``sequence_hash % slots``, so a reader finds
it without the writer's help. One writer per segment, many readers, no locks: the writer marks a
slot invalid, writes the bytes, then the checksum (xxh3 of the bytes), then marks it valid; a
reader copies the bytes and accepts them only if the slot is valid and still names the block
before and after the copy and the checksum matches: a torn read is a miss, never wrong bytes.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import struct
from pathlib import Path

import numpy as np
import xxhash

MAGIC = b"KVMPOOL1"
VERSION = 1
HEADER = struct.Struct("<8sIIIQ")  # magic, version, block bytes, slots, writer id
HEADER_BYTES = 64
PROBE_SLOTS = 8
_EMPTY, _WRITING, _VALID = 0, 1, 2
SEGMENT_SUFFIX = ".kvseg"


def _layout(block_bytes: int, num_slots: int) -> tuple[int, int]:
    """(offset of the block regions, file size)."""
    data_offset = HEADER_BYTES + num_slots * 24
    data_offset = (data_offset + 63) // 64 * 64
    return data_offset, data_offset + num_slots * block_bytes


class PoolSegment:
    """One writer's segment, mapped read-only (another worker's) or read-write (this worker's)."""

    def __init__(self, path: Path, writable: bool) -> None:
        self.path = path
        self.writable = writable
        with open(path, "r+b" if writable else "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size < HEADER_BYTES:
                raise ValueError(f"{path} is not a KV pool segment (too short)")
            self._map = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        magic, version, self.block_bytes, self.num_slots, self.writer_id = HEADER.unpack_from(self._map, 0)
        data_offset, expected = _layout(self.block_bytes, self.num_slots)
        if magic != MAGIC or version != VERSION or size != expected:
            self._map.close()
            raise ValueError(f"{path} is not a version-{VERSION} KV pool segment")
        self._entries = np.ndarray((self.num_slots, 3), np.uint64, self._map, HEADER_BYTES)
        self._blocks = np.ndarray((self.num_slots, self.block_bytes), np.uint8, self._map, data_offset)
        # the writer's own bookkeeping: where each block is, what each slot holds, when it was written
        self._slot_of: dict[int, int] = {}
        self._held: dict[int, int] = {}
        self._stamp: dict[int, int] = {}
        self._clock = itertools.count()

    @classmethod
    def create(cls, path: Path, block_bytes: int, num_slots: int, writer_id: int) -> PoolSegment:
        if block_bytes <= 0 or num_slots < PROBE_SLOTS:
            raise ValueError(f"a segment needs block_bytes > 0 and at least {PROBE_SLOTS} slots")
        _, size = _layout(block_bytes, num_slots)
        partial = path.with_suffix(".partial")
        with open(partial, "wb") as file:
            file.truncate(size)  # sparse: pages cost memory only once written
            file.write(HEADER.pack(MAGIC, VERSION, block_bytes, num_slots, writer_id))
        os.replace(partial, path)  # readers never see a half-written header
        return cls(path, writable=True)

    def _window(self, sequence_hash: int) -> list[int]:
        home = sequence_hash % self.num_slots
        return [(home + i) % self.num_slots for i in range(PROBE_SLOTS)]

    def holds(self, sequence_hash: int) -> bool:
        return sequence_hash in self._slot_of

    def write(self, sequence_hash: int, data: memoryview | bytes, commit: bool = True) -> int | None:
        """Store a block (writer only); returns the block it evicted, if any. With ``commit`` False
        the block is a copy in flight: written and checksummed but a miss to readers until
        :meth:`commit` (the writer publishes it as ``in_transit`` meanwhile)."""
        if not self.writable:
            raise PermissionError(f"{self.path} belongs to another worker")
        if sequence_hash in self._slot_of:
            self._stamp[self._slot_of[sequence_hash]] = next(self._clock)
            return None
        window = self._window(sequence_hash)
        slot = next((slot for slot in window if slot not in self._held), None)
        evicted = None
        if slot is None:  # the least recently written block of the window goes
            slot = min(window, key=self._stamp.__getitem__)
            evicted = self._held.pop(slot)
            del self._slot_of[evicted]
        entry = self._entries[slot]
        entry[2] = _WRITING
        entry[0] = sequence_hash
        self._blocks[slot] = np.frombuffer(data, np.uint8)
        entry[1] = xxhash.xxh3_64_intdigest(self._blocks[slot].data)
        if commit:
            entry[2] = _VALID
        self._slot_of[sequence_hash] = slot
        self._held[slot] = sequence_hash
        self._stamp[slot] = next(self._clock)
        return evicted

    def commit(self, sequence_hash: int) -> bool:
        """Make a block written with ``commit=False`` readable; False if it was evicted meanwhile."""
        slot = self._slot_of.get(sequence_hash)
        if slot is None:
            return False
        self._entries[slot][2] = _VALID
        return True

    def read(self, sequence_hash: int) -> bytes | None:
        """The block's bytes, checked against its checksum; None when absent or being rewritten."""
        for slot in self._window(sequence_hash):
            entry = self._entries[slot]
            if int(entry[2]) != _VALID or int(entry[0]) != sequence_hash:
                continue
            checksum = int(entry[1])
            data = self._blocks[slot].tobytes()
            if (
                int(entry[2]) == _VALID
                and int(entry[0]) == sequence_hash
                and xxhash.xxh3_64_intdigest(data) == checksum
            ):
                return data
        return None

    def contents(self) -> list[int]:
        """The blocks this writer holds."""
        return list(self._slot_of)

    def close(self) -> None:
        self._entries = self._blocks = None  # type: ignore[assignment]  # release the buffer views first
        with contextlib.suppress(BufferError):
            self._map.close()


class KvPool:
    """This worker's view of the pool directory: its own segment (write-through) and everyone's
    (reads). Guarantees: :meth:`get` returns a block's exact bytes as its writer wrote them, or None."""

    def __init__(self, directory: Path, writer_id: int, block_bytes: int, num_slots: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.pool_id = directory.name
        self.block_bytes = block_bytes
        self.own = PoolSegment.create(directory / f"{writer_id}{SEGMENT_SUFFIX}", block_bytes, num_slots, writer_id)
        self._others: dict[Path, PoolSegment | None] = {}  # None: unreadable or another shape

    def put(self, sequence_hash: int, data: memoryview | bytes, commit: bool = True) -> int | None:
        return self.own.write(sequence_hash, data, commit)

    def get(self, sequence_hash: int) -> bytes | None:
        found = self.read_prefix([sequence_hash])
        return found[0] if found else None

    def read_prefix(self, sequence_hashes: list[int]) -> list[bytes]:
        """The bytes of the longest run of these blocks, from the start, that the pool holds. Reads
        the directory once, and tries first the segment that held the previous block (a prompt's
        blocks were usually written by one worker)."""
        segments = [self.own, *self._segments()]
        found: list[bytes] = []
        for sequence_hash in sequence_hashes:
            for index, segment in enumerate(segments):
                content = segment.read(sequence_hash)
                if content is not None:
                    if index:
                        segments.insert(0, segments.pop(index))
                    found.append(content)
                    break
            else:
                break
        return found

    def _segments(self) -> list[PoolSegment]:
        for path in [path for path in self._others if not path.exists()]:  # the pool removed it
            segment = self._others.pop(path)
            if segment is not None:
                segment.close()
        for path in self.directory.glob(f"*{SEGMENT_SUFFIX}"):
            if path != self.own.path and path not in self._others:
                try:
                    segment: PoolSegment | None = PoolSegment(path, writable=False)
                except (OSError, ValueError):
                    segment = None
                if segment is not None and segment.block_bytes != self.block_bytes:
                    segment.close()
                    segment = None
                self._others[path] = segment
        return [segment for segment in self._others.values() if segment is not None]

    def close(self, remove_own: bool = True) -> None:
        """Unmap everything; a worker stopping cleanly removes its segment (a killed one cannot)."""
        for segment in self._others.values():
            if segment is not None:
                segment.close()
        self.own.close()
        if remove_own:
            self.own.path.unlink(missing_ok=True)
