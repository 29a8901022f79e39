"""A worker streams whatever tokens are ready in one message: ``take_ready`` takes a request's queued
outputs up to its last one, and stops in front of a failure so the tokens before it still go out."""

from __future__ import annotations

from kvmesh.common.wire.finish_reasons import FinishReason
from kvmesh.worker.engine import EngineFailure, TokenOutput, TokenQueue, take_ready


def token(token_id: int | None, finish: FinishReason | None = None) -> TokenOutput:
    return TokenOutput("r", token_id, finish, cached_tokens=16)


def queued(*items) -> TokenQueue:
    queue = TokenQueue()
    for item in items:
        queue.put_nowait(item)
    return queue


def test_a_reader_that_keeps_up_gets_each_token_alone():
    output, tokens, failure = take_ready(queued(), token(7))
    assert (output.token_id, tokens, failure) == (7, [7], None)


def test_ready_tokens_ride_together_up_to_the_last_and_the_next_request_part_stays_queued():
    queue = queued(token(2), token(3, FinishReason.LENGTH), token(99))
    output, tokens, failure = take_ready(queue, token(1))
    assert tokens == [1, 2, 3] and output.finish_reason is FinishReason.LENGTH and failure is None
    assert queue.qsize() == 1  # nothing past the last output is taken


def test_a_last_output_without_a_token_ends_the_batch():
    output, tokens, _ = take_ready(queued(token(None, FinishReason.STOP)), token(5))
    assert tokens == [5] and output.finish_reason is FinishReason.STOP and output.token_id is None


def test_tokens_before_a_failure_are_kept_and_the_failure_is_returned():
    boom = EngineFailure("engine died")
    output, tokens, failure = take_ready(queued(token(2), boom, token(3)), token(1))
    assert tokens == [1, 2] and output.token_id == 2 and failure is boom
