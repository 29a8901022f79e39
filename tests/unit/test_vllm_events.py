"""vLLM's KV cache events in kvmesh's format: keys from token ids, removals by vLLM's block hash, the
block set DumpKvState reports; and the relay's ordering and gap recovery over real ZMQ sockets."""

from __future__ import annotations

import asyncio
import itertools

import msgpack
import pytest

from kvmesh.common.runtime.ports import free_port
from kvmesh.common.wire.hashing import local_block_hashes, sequence_hashes
from kvmesh.common.wire.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored
from kvmesh.worker.engines.vllm.vllm_events import MEDIUMS_BY_TIER, VllmEventRelay, VllmEventTranslator, decode_batch
from tests.support import wait_until_async

BLOCK = 4
TOKENS = list(range(100, 112))  # three blocks


def stored(hashes, tokens, parent=None, medium="GPU", lora_name=None) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BLOCK,
        "lora_id": None,
        "medium": medium,
        "lora_name": lora_name,
    }


def test_stored_blocks_get_our_keys_and_keep_vllms_ids_for_parents():
    translator = VllmEventTranslator()
    (first,) = translator.translate([stored([11, 12], TOKENS[:8])])
    (second,) = translator.translate([stored([13], TOKENS[8:], parent=12)])
    local = local_block_hashes(TOKENS, BLOCK)
    assert isinstance(first, BlocksStored) and first.parent_hash is None
    assert [b.block_hash for b in first.blocks] == [11, 12]
    assert [b.tokens_hash for b in first.blocks + second.blocks] == local
    assert second.parent_hash == 12
    dump = {b.block_hash: b for b in translator.cached_blocks()}
    assert [dump[h].sequence_hash for h in (11, 12, 13)] == sequence_hashes(local)
    assert dump[13].parent_hash == 12 and dump[11].parent_hash is None


def test_removals_and_clears_shrink_the_block_set():
    translator = VllmEventTranslator()
    translator.translate([stored([11, 12, 13], TOKENS)])
    (removed,) = translator.translate([{"type": "BlockRemoved", "block_hashes": [13], "medium": "GPU"}])
    assert removed == BlocksRemoved((13,)) and len(translator) == 2
    (cleared,) = translator.translate([{"type": "AllBlocksCleared"}])
    assert isinstance(cleared, AllBlocksCleared) and len(translator) == 0


def test_a_lora_changes_the_keys_and_offloaded_tiers_are_skipped():
    translator = VllmEventTranslator()
    (base,) = translator.translate([stored([1], TOKENS[:4])])
    (adapted,) = translator.translate([stored([2], TOKENS[:4], lora_name="sql")])
    assert base.blocks[0].tokens_hash != adapted.blocks[0].tokens_hash
    assert translator.translate([stored([3], TOKENS[:4], medium="CPU")]) == []
    assert translator.skipped_events == 1 and len(translator) == 2


def test_offloaded_media_are_followed_by_a_translator_of_their_own_tier():
    events = [stored([1], TOKENS[:4]), stored([7], TOKENS[:4], medium="CPU"), stored([9], TOKENS[:4], medium="DISK")]
    device, host, disk = (VllmEventTranslator(MEDIUMS_BY_TIER[tier]) for tier in ("device", "host", "disk"))
    assert [e.blocks[0].block_hash for e in device.translate(events)] == [1]
    (offloaded,) = host.translate(events)
    assert offloaded.blocks[0].block_hash == 7 and [b.block_hash for b in host.cached_blocks()] == [7]
    # the same tokens: the same key in every tier, so the index credits the tier the prefix is in
    assert offloaded.blocks[0].tokens_hash == device.cached_blocks()[0].tokens_hash
    assert [e.blocks[0].block_hash for e in disk.translate(events)] == [9]
    removed = host.translate([{"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU"}])
    assert removed == [BlocksRemoved((7,))] and len(host) == 0 and len(device) == 1


def test_a_block_whose_parent_is_unknown_is_relayed_but_not_reported_as_cached():
    """Its sequence hash cannot be known; the indexer links it by vLLM's id and recovers if needed."""
    translator = VllmEventTranslator()
    (event,) = translator.translate([stored([21], TOKENS[4:8], parent=999)])
    assert event.parent_hash == 999 and len(translator) == 0


def test_byte_block_hashes_become_u64_ids():
    translator = VllmEventTranslator()
    (event,) = translator.translate([stored([b"\x01" + b"\x00" * 31], TOKENS[:4])])
    assert event.blocks[0].block_hash == 1


def batch(events: list[dict]) -> bytes:
    return msgpack.packb([1.0, events, 0])


def test_a_batch_payload_decodes_to_its_events():
    assert decode_batch(batch([stored([1], TOKENS[:4])]))[0]["block_hashes"] == [1]


class FakeVllmPublisher:
    """vLLM's publisher side over real sockets: PUB connecting to the relay, ROUTER serving replays."""

    def __init__(self, relay: VllmEventRelay) -> None:
        import zmq
        import zmq.asyncio

        self.context = zmq.asyncio.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.connect(relay.sub_endpoint)
        self.replay = self.context.socket(zmq.ROUTER)
        self.replay.bind(relay.replay_endpoint)
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = itertools.count()

    async def publish(self, events: list[dict], send: bool = True) -> None:
        seq = next(self.seq)
        payload = batch(events)
        self.buffer.append((seq, payload))
        if send:
            await self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    async def serve_one_replay(self) -> None:
        client, _, start = await self.replay.recv_multipart()
        for seq, payload in self.buffer:
            if seq >= int.from_bytes(start, "big"):
                await self.replay.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), payload))
        await self.replay.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))

    def close(self) -> None:
        self.pub.close(linger=0)
        self.replay.close(linger=0)
        self.context.term()


async def test_the_relay_delivers_in_order_and_recovers_a_gap_from_the_replay_socket():
    pytest.importorskip("zmq")
    delivered: list[list] = []
    relay = VllmEventRelay(
        f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", VllmEventTranslator(), delivered.append
    )
    await relay.start()
    publisher = FakeVllmPublisher(relay)
    try:
        # a PUB socket drops what it sends before the connection is up: send until the first arrives
        async def first_arrived() -> bool:
            if not delivered:
                await publisher.pub.send_multipart((b"", (0).to_bytes(8, "big"), batch([stored([1], TOKENS[:4])])))
            return bool(delivered)

        publisher.buffer.append((next(publisher.seq), batch([stored([1], TOKENS[:4])])))
        await wait_until_async(first_arrived, what="the relay to receive its first batch")
        await publisher.publish([stored([2], TOKENS[4:8], parent=1)], send=False)  # lost on the way
        await publisher.publish([stored([3], TOKENS[8:], parent=2)])
        replay = asyncio.create_task(publisher.serve_one_replay())
        await wait_until_async(lambda: relay.batches == 3, what="the gap recovered and the batch applied")
        await replay
        assert relay.replayed == 1 and relay.lost == 0
        ids = [event.blocks[0].block_hash for events in delivered for event in events]
        assert ids[-2:] == [2, 3]  # in sequence order, the replayed batch first
        assert len(relay.translator) == 3
    finally:
        publisher.close()
        await relay.stop()


def test_vllms_connector_stats_become_the_workers_transfer_counters():
    from kvmesh.worker.engines.vllm.vllm_engine import record_connector_stats
    from kvmesh.worker.kv_transfer.transport import TransferStats

    stats = TransferStats()
    record_connector_stats({"transfer_duration": [0.002, 0.003], "bytes_transferred": [4096, 8192]}, stats)
    record_connector_stats({"num_failed_transfers": [1], "transfer_duration": [], "bytes_transferred": []}, stats)
    assert stats.bytes_received == {"nixl": 12288}
    assert stats.pulls == {"ok": 2, "failed": 1}
    assert stats.pull_seconds["nixl"] == pytest.approx(0.005)
