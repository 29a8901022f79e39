"""Fuzzing the KV event decoder: whatever bytes arrive on the stream, decoding gives a batch or an
EventDecodeError (which the indexer counts and skips), never another exception that would stop a
replica. Random bytes, random msgpack documents, and real batches with one field replaced."""

from __future__ import annotations

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.common.wire.kv_events import EventDecodeError, KvEventBatch, decode_batch

EXAMPLES = 400

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=8),
)
documents = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=12), st.integers(-(2**63), 2**63 - 1)), inner, max_size=5),
    ),
    max_leaves=20,
)
FIELDS = ["worker_id", "dp_rank", "ts", "events"]
EVENT_FIELDS = ["event_id", "tier", "data"]
DATA_FIELDS = ["type", "blocks", "parent_hash", "block_hashes"]


def decodes_or_refuses(payload: bytes) -> None:
    try:
        batch = decode_batch(payload)
    except EventDecodeError:
        return
    assert isinstance(batch, KvEventBatch)


def valid_document() -> dict:
    stored = {
        "type": "stored",
        "parent_hash": 7,
        "blocks": [{"block_hash": 1, "tokens_hash": 2, "num_tokens": 16}],
    }
    return {"worker_id": 1, "dp_rank": 0, "ts": 1.5, "events": [{"event_id": 0, "tier": "device", "data": stored}]}


@settings(max_examples=EXAMPLES, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=64))
def test_random_bytes(payload: bytes):
    decodes_or_refuses(payload)


@settings(max_examples=EXAMPLES, suppress_health_check=[HealthCheck.too_slow])
@given(documents)
def test_random_msgpack_documents(document):
    decodes_or_refuses(msgpack.packb(document))


@settings(max_examples=EXAMPLES, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["batch", "event", "data", "block"]), st.data(), documents)
def test_a_real_batch_with_one_field_replaced(level: str, data, value):
    document = valid_document()
    event = document["events"][0]
    target, fields = {
        "batch": (document, FIELDS),
        "event": (event, EVENT_FIELDS),
        "data": (event["data"], DATA_FIELDS),
        "block": (event["data"]["blocks"][0], ["block_hash", "tokens_hash", "num_tokens"]),
    }[level]
    target[data.draw(st.sampled_from(fields))] = value
    decodes_or_refuses(msgpack.packb(document))
