"""The typed messages that ride in ``disaggregated_params`` and in a KV pull's control frames."""

from __future__ import annotations

import msgpack
import pytest

from kvmesh.common.wire import disagg
from kvmesh.common.wire.disagg import DecodeOrder, DisaggParamsError, KvReady, KvSource, PrefillOrder, PrefixPull
from kvmesh.worker.kv_transfer.messages import (
    PullDone,
    PullGranted,
    PullRefused,
    PullRequest,
    TransferError,
    answer_from_frame,
)

READY = KvReady(room=7, host="10.0.0.1", port=9000, worker_id=3, blocks=6, backend="nixl")


@pytest.mark.parametrize(
    "message",
    [
        PrefillOrder(7),
        READY,
        DecodeOrder(7, "h", 1, 3, allow_local=False),
        KvSource("remote", "tcp", 4096, 6),
        PrefixPull(3, "10.0.0.1:50051", [2**64 - 1, 0, 17]),
    ],
    ids=lambda m: m.kind,
)
def test_every_message_round_trips(message):
    assert disagg.decode(disagg.encode(message)) == message
    assert disagg.decode_as(disagg.encode(message), type(message)) == message


def test_a_decode_order_takes_the_rendezvous_from_the_prefill_answer():
    assert DecodeOrder.from_ready(READY, allow_local=True) == DecodeOrder(7, "10.0.0.1", 9000, 3, True)


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb([1, 2]), "no known kind"),
        (msgpack.packb({"kind": "prefilled", "room": 1}), "no known kind"),
        (msgpack.packb({"kind": "decode", "room": "1", "host": "h", "port": 1, "worker_id": 1}), "must be int"),
        (msgpack.packb({"kind": "decode", "room": 1}), "malformed"),
        (msgpack.packb({"kind": "prefix_pull", "worker_id": 1, "address": "a", "sequence_hashes": 5}), "must be list"),
        (
            msgpack.packb({"kind": "prefix_pull", "worker_id": 1, "address": "a", "sequence_hashes": [1, -2]}),
            "unsigned integers",
        ),
    ],
)
def test_garbage_is_a_clear_error(data, error):
    with pytest.raises(DisaggParamsError, match=error):
        disagg.decode(data)


def test_the_wrong_message_is_refused_where_one_kind_is_expected():
    with pytest.raises(DisaggParamsError, match="expected 'kv_source' params, got 'kv_ready'"):
        disagg.decode_as(disagg.encode(READY), KvSource)


def test_pull_frames_round_trip():
    ask = PullRequest(room=1, first_block=2, num_blocks=3, block_bytes=512, backend="tcp", wait_s=4.5)
    assert PullRequest.from_frame(msgpack.unpackb(msgpack.packb(ask.to_frame()))) == ask
    granted = PullGranted("nixl", [4, 5, 6], "agent", b"meta", 1 << 40)
    assert answer_from_frame(msgpack.unpackb(msgpack.packb(granted.to_frame()))) == granted
    refused = PullRefused("room failed", retry=False)
    assert answer_from_frame(refused.to_frame()) == refused
    assert PullDone.from_frame(PullDone().to_frame()).received


def test_a_malformed_pull_request_is_not_retryable():
    frame = PullRequest(1, 2, 3, 512, "tcp", 1.0).to_frame() | {"num_blocks": "three"}
    with pytest.raises(TransferError, match="num_blocks must be int") as caught:
        PullRequest.from_frame(frame)
    assert not caught.value.retryable
    with pytest.raises(TransferError, match="malformed"):
        PullRequest.from_frame({"room": 1})
