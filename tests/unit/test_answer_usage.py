"""The usage of one answer across its tries, as the client sees it."""

from kvmesh.common.proto.kvmesh.v1 import common_pb2
from kvmesh.common.wire.requests import AnswerUsage


def output(tokens: list[int], cached: int) -> common_pb2.GenerateOutput:
    return common_pb2.GenerateOutput(token_ids=tokens, usage=common_pb2.Usage(cached_prompt_tokens=cached))


def test_the_cached_tokens_are_the_first_tries_as_its_latest_output_says():
    usage = AnswerUsage(prompt_tokens=849)
    # an engine server says its cached tokens only with its last output (vLLM's streamed usage)
    assert usage.account(output([1], 0)).usage.cached_prompt_tokens == 0
    assert usage.account(output([2], 832)).usage.cached_prompt_tokens == 832
    # a later try (a migration) prefills prompt and tokens again: its cache hit is not the client's
    moved = usage.account(output([3], 851), attempt=1)
    assert moved.usage.cached_prompt_tokens == 832
    assert moved.usage.completion_tokens == 3 and moved.usage.prompt_tokens == 849
