"""Facts about a preprocessed request that several services rely on."""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.common.proto.kvmesh.v1 import common_pb2

# What a worker generates when a request names no max_tokens (the router accounts with the same).
DEFAULT_MAX_TOKENS = 16


def continue_request(
    request: common_pb2.PreprocessedRequest, generated: Sequence[int], max_tokens: int, suffix: str
) -> common_pb2.PreprocessedRequest:
    """The request that carries on after ``generated`` tokens elsewhere (another worker after a
    migration, another router after a failover): the prompt grows by those tokens, the budget shrinks
    by them, and the id gets ``suffix`` so the new attempt never clashes with the old one."""
    moved = common_pb2.PreprocessedRequest()
    moved.CopyFrom(request)
    moved.request_id = f"{request.request_id}:{suffix}"
    moved.token_ids.extend(generated)
    moved.stop.max_tokens = max_tokens - len(generated)
    # a remote prefill's KV covered the old prompt only; the new attempt prefills where it lands
    moved.ClearField("disaggregated_params")
    return moved
