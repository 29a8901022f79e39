"""DESIGN §2 hashing, pinned by golden vectors and re-derived independently from the definition."""

import struct

import pytest
import xxhash

from kvmesh.common.wire.hashing import (
    blocks_needed,
    hash_block_tokens,
    local_block_hashes,
    lora_seed,
    next_sequence_hash,
    sequence_hashes,
    token_array,
    token_bytes,
)

TOKENS = list(range(1, 33))  # two blocks of 16
# Golden vectors: xxh3_64 seed 1337 over LE u32 tokens / LE u64 (parent ‖ local). Changing these
# breaks interoperability with every published hash; do not update them to make a test pass.
GOLDEN_LOCAL = [16863443419780771464, 2287610619914608821]
GOLDEN_SEQUENCE = [16863443419780771464, 12466389667045779788]
GOLDEN_LORA_LOCAL = [13258184797993000032, 14705587815847232071]


def test_local_hashes_match_golden_vectors():
    assert local_block_hashes(TOKENS, 16) == GOLDEN_LOCAL


def test_sequence_hashes_match_golden_vectors():
    assert sequence_hashes(GOLDEN_LOCAL) == GOLDEN_SEQUENCE


def test_golden_vectors_follow_the_written_definition():
    first = xxhash.xxh3_64_intdigest(struct.pack("<16I", *TOKENS[:16]), seed=1337)
    second = xxhash.xxh3_64_intdigest(struct.pack("<16I", *TOKENS[16:]), seed=1337)
    chained = xxhash.xxh3_64_intdigest(struct.pack("<QQ", first, second), seed=1337)
    assert [first, second] == GOLDEN_LOCAL
    assert chained == GOLDEN_SEQUENCE[1] == next_sequence_hash(first, second)


def test_trailing_partial_block_is_not_hashed():
    assert local_block_hashes([*TOKENS, 99, 100], 16) == GOLDEN_LOCAL
    assert local_block_hashes(TOKENS[:15], 16) == []


def test_lora_adapters_never_share_blocks():
    assert local_block_hashes(TOKENS, 16, "my-lora") == GOLDEN_LORA_LOCAL
    assert local_block_hashes(TOKENS, 16, "other") != GOLDEN_LORA_LOCAL
    assert lora_seed(None) == 1337


def test_sequence_hash_depends_on_the_prefix():
    a = sequence_hashes(local_block_hashes([7] * 16 + [9] * 16, 16))
    b = sequence_hashes(local_block_hashes([8] * 16 + [9] * 16, 16))
    assert local_block_hashes([9] * 16, 16)[0] == hash_block_tokens([9] * 16)
    assert a[1] != b[1]


def test_continuing_a_prefix_equals_hashing_the_whole():
    whole = sequence_hashes(GOLDEN_LOCAL)
    assert sequence_hashes(GOLDEN_LOCAL[1:], parent_sequence_hash=whole[0]) == whole[1:]


def test_block_size_must_be_positive():
    with pytest.raises(ValueError):
        local_block_hashes(TOKENS, 0)


def test_blocks_needed_counts_partial_blocks():
    assert [blocks_needed(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_token_arrays_hash_like_lists():
    from array import array

    assert local_block_hashes(array("I", TOKENS), 16) == GOLDEN_LOCAL
    assert hash_block_tokens(array("I", TOKENS[:16])) == GOLDEN_LOCAL[0]


def test_a_requests_token_ids_hash_like_lists_whatever_their_container():
    from kvmesh.common.proto.kvmesh.v1 import common_pb2

    with_partial = [*TOKENS, 99, 100, 2**32 - 1]  # a trailing partial block, and the largest id
    request = common_pb2.PreprocessedRequest(token_ids=with_partial)
    assert local_block_hashes(request.token_ids, 16) == GOLDEN_LOCAL
    assert local_block_hashes(tuple(with_partial), 16) == GOLDEN_LOCAL
    expected = struct.pack(f"<{len(with_partial)}I", *with_partial)
    assert token_bytes(request.token_ids) == token_bytes(with_partial) == expected
    assert token_bytes(request.token_ids[:0]) == token_bytes(common_pb2.PreprocessedRequest().token_ids) == b""


def test_a_requests_token_ids_pack_into_an_array_that_reads_and_hashes_like_the_list():
    from kvmesh.common.proto.kvmesh.v1 import common_pb2

    tokens = [*TOKENS, 99, 2**32 - 1]
    packed = token_array(common_pb2.PreprocessedRequest(token_ids=tokens).token_ids)
    assert list(packed) == tokens and packed[-1] == 2**32 - 1 and len(packed) == len(tokens)
    assert local_block_hashes(packed, 16) == GOLDEN_LOCAL
    assert token_bytes(packed) == token_bytes(tokens)
    assert list(token_array([])) == []
