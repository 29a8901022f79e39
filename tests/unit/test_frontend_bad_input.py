"""Bad input to the HTTP facade gets a 4xx in OpenAI's error shape, never a 500 or FastAPI's own
shape, and parameters kvmesh cannot honour are refused instead of silently ignored. The app runs in
process (validation happens before any router is asked)."""

from __future__ import annotations

import httpx
import pytest

from kvmesh.common.calling.request_path import RequestPath
from kvmesh.common.calling.router_client import RouterClient
from kvmesh.common.core.tiny_model import MODEL_DIR, MODEL_NAME
from kvmesh.frontend.app import create_app
from kvmesh.frontend.gateway import Frontend, ServedModel
from kvmesh.frontend.tokenizer import ModelTokenizer

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": MODEL_NAME, "prompt": "hi"}


@pytest.fixture
async def http():
    tokenizer = ModelTokenizer(MODEL_DIR)
    app = create_app(
        Frontend(ServedModel(MODEL_NAME, tokenizer, 0), RequestPath(RouterClient(fixed_address="127.0.0.1:1")))
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://frontend") as client:
        yield client


def openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


async def test_a_body_nested_100000_deep_is_a_400(http):
    response = await http.post("/v1/chat/completions", content=b"[" * 100_000)
    assert "nested too deeply" in openai_error(response, 400)["message"]


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"max_tokens": 10**12}, "max_tokens"),
        ("/v1/chat/completions", {"max_completion_tokens": 2**32}, "max_completion_tokens"),
        ("/v1/completions", {"seed": 2**70}, "seed"),
        ("/v1/completions", {"kvmesh": {"worker_id": -1}}, "kvmesh.worker_id"),
        ("/v1/completions", {"kvmesh": {"worker_id": 2**64}}, "kvmesh.worker_id"),
        ("/v1/completions", {"kvmesh": {"expected_output_tokens": 2**40}}, "kvmesh.expected_output_tokens"),
        ("/v1/completions", {"prompt": [1, 2**33]}, "prompt"),
        (
            "/v1/completions",
            {"kvmesh": {"router_config_override": {"moe_query": [{"layer": -1, "expert": 2}]}}},
            "kvmesh.router_config_override.moe_query",
        ),
    ],
)
async def test_integers_out_of_their_range_are_a_400_naming_the_field(http, path, extra, param):
    body = {**(CHAT if "chat" in path else COMPLETION), **extra}
    error = openai_error(await http.post(path, json=body), 400)
    assert error["param"].startswith(param)


async def test_max_tokens_past_the_models_context_is_a_400_as_in_vllm(http):
    limit = ModelTokenizer(MODEL_DIR).max_length
    assert limit is not None
    error = openai_error(await http.post("/v1/completions", json={**COMPLETION, "max_tokens": limit}), 400)
    assert f"maximum context length is {limit} tokens" in error["message"] and error["param"] == "max_tokens"


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/v1/completions", {"logprobs": 2}),
        ("/v1/completions", {"echo": True}),
        ("/v1/completions", {"best_of": 3}),
        ("/v1/completions", {"suffix": "the end"}),
        ("/v1/chat/completions", {"logprobs": True}),
        ("/v1/chat/completions", {"top_logprobs": 5}),
    ],
)
async def test_parameters_kvmesh_cannot_honour_are_refused_not_ignored(http, path, extra):
    body = {**(CHAT if "chat" in path else COMPLETION), **extra}
    error = openai_error(await http.post(path, json=body), 400)
    (name,) = extra
    assert error["param"] == name and "not supported" in error["message"]


async def test_their_defaults_are_accepted(http):
    from kvmesh.frontend.protocol import ChatCompletionRequest, CompletionRequest

    CompletionRequest.model_validate({**COMPLETION, "logprobs": None, "echo": False, "best_of": 1})
    ChatCompletionRequest.model_validate({**CHAT, "logprobs": False, "top_logprobs": 0})


async def test_unknown_paths_and_wrong_methods_answer_in_openais_shape(http):
    assert "/v1/nothing" in openai_error(await http.get("/v1/nothing"), 404)["message"]
    assert "GET" in openai_error(await http.get("/v1/completions"), 405)["message"]
