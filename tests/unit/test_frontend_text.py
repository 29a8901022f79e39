import pytest

from kvmesh.common.core.tiny_model import MODEL_DIR
from kvmesh.frontend.app import parse_body
from kvmesh.frontend.errors import BadRequestError
from kvmesh.frontend.protocol import ChatCompletionRequest, CompletionRequest
from kvmesh.frontend.tokenizer import IncrementalDetokenizer, ModelTokenizer, StopStringMatcher


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(MODEL_DIR)


def test_chat_template_renders_chatml(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text)
    assert ids[0] == 257 and tokenizer.decode(ids) == "user\nhi\nassistant\n"


@pytest.mark.parametrize("text", ["", "<|im_start|>user\nhi<|im_end|>\n", "naïve 漢字 🙂 " * 50, "a" * 5000])
def test_encode_gives_the_ids_of_the_full_encoding(tokenizer, text):
    assert tokenizer.encode(text) == tokenizer.tokenizer.encode(text, add_special_tokens=False).ids


def test_shared_text_prefix_gives_shared_token_prefix(tokenizer):
    a = tokenizer.encode("the same long system prompt, then question one")
    b = tokenizer.encode("the same long system prompt, then another question")
    common = len("the same long system prompt, then ")
    assert a[:common] == b[:common]


def test_incremental_detokenizer_holds_back_partial_utf8(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    e_acute = "é".encode()
    assert detok.add([e_acute[0]]) == ""
    assert detok.add([e_acute[1]]) == "é"
    assert detok.add([ord("x")]) == "x"


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_incremental_deltas_join_to_the_whole_decode(tokenizer, chunk):
    ids = tokenizer.encode("<|im_start|>assistant\nnaïve café, 漢字 and emoji 🙂 " * 4)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    assert "".join(deltas) == tokenizer.decode(ids) == detok.text
    assert all("\ufffd" not in delta for delta in deltas)


def test_stop_strings_cut_the_text_and_never_leak_a_partial_stop():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("hello ST") == ("hello ", False)
    assert matcher.feed("O") == ("", False)
    assert matcher.feed("P and more") == ("", True)


def test_held_text_is_released_when_it_is_not_a_stop():
    matcher = StopStringMatcher(["abc"])
    assert matcher.feed("xa") == ("x", False)
    assert matcher.feed("b!") == ("ab!", False)
    assert matcher.flush() == ""
    matcher = StopStringMatcher(["abc"])
    matcher.feed("ab")
    assert matcher.flush() == "ab"


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"model": "m"}', "messages"),
        (b'{"model": "m", "messages": []}', "messages"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}', "n=1"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 5}', "temperature"),
        (b'{"model": "m", "messages": [{"role": "wizard", "content": "x"}]}', "role"),
    ],
)
def test_invalid_chat_bodies_are_400_naming_the_problem(raw, fragment):
    with pytest.raises(BadRequestError) as info:
        parse_body(ChatCompletionRequest, raw)
    assert fragment in info.value.message
    assert info.value.status_code == 400


def test_valid_bodies_parse_and_ignore_unknown_fields():
    chat = parse_body(
        ChatCompletionRequest,
        b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],'
        b' "user": "someone", "stop": "x", "kvmesh": {"worker_id": 5}}',
    )
    assert chat.template_messages() == [{"role": "user", "content": "hi"}]
    assert chat.stop_strings() == ["x"] and chat.kvmesh.worker_id == 5
    completion = parse_body(CompletionRequest, b'{"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}')
    assert completion.prompt == [1, 2, 3] and completion.requested_max_tokens() == 4
