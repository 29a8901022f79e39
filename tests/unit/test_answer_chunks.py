"""A streamed answer's events from the per-answer template are the bytes the chunk dict renders to."""

from __future__ import annotations

import json
import random

import pytest

from kvmesh.frontend.answer_chunks import AnswerChunks, sse_event

TEXTS = ["", "a", ' "quoted" ', "back\\slash", "line\nbreak\ttab", "é ü 漢字 🙂", "\x00", "\x00kvmesh-text\x00", "</s>"]


def random_texts(count: int) -> list[str]:
    rng = random.Random(7)
    alphabet = [chr(c) for c in range(0, 0x250)] + ["🙂", "\u2028", "\ud7ff", '"', "\\"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12))) for _ in range(count)]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("include_usage", [True, False])
def test_every_event_is_the_rendered_chunk(chat: bool, include_usage: bool) -> None:
    chunks = AnswerChunks("chatcmpl-1f2e", "kvmesh-tiny", 1795530700, chat, include_usage)
    for text in TEXTS + random_texts(300):
        assert chunks.event(text) == sse_event(chunks.chunk(text))
        assert chunks.event(text, first=True) == sse_event(chunks.chunk(text, first=True))
        assert chunks.event(text, "length") == sse_event(chunks.chunk(text, "length"))


def test_the_events_read_back_as_openai_chunks() -> None:
    chunks = AnswerChunks("chatcmpl-1f2e", "kvmesh-tiny", 1795530700, chat=True, include_usage=False)
    first = json.loads(chunks.event("Hel", first=True).removeprefix(b"data: "))
    middle = json.loads(chunks.event('lo "you"').removeprefix(b"data: "))
    last = json.loads(chunks.event("!", "stop").removeprefix(b"data: "))
    assert first["choices"][0]["delta"] == {"content": "Hel", "role": "assistant"}
    expected = {"index": 0, "delta": {"content": 'lo "you"'}, "finish_reason": None, "logprobs": None}
    assert middle["choices"][0] == expected
    assert last["choices"][0]["finish_reason"] == "stop"
    envelope = (middle["id"], middle["object"], middle["model"])
    assert envelope == ("chatcmpl-1f2e", "chat.completion.chunk", "kvmesh-tiny")


def test_a_model_named_as_the_placeholder_is_rendered_whole() -> None:
    chunks = AnswerChunks("cmpl-9", "\x00kvmesh-text\x00", 1, chat=False, include_usage=True)
    for text in TEXTS:
        assert chunks.event(text) == sse_event(chunks.chunk(text))


def test_the_usage_event_closes_with_no_choices() -> None:
    chunks = AnswerChunks("chatcmpl-1f2e", "kvmesh-tiny", 5, chat=True, include_usage=True)
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    event = json.loads(chunks.usage_event(usage).removeprefix(b"data: "))
    assert event["choices"] == [] and event["usage"] == usage and event["object"] == "chat.completion.chunk"
