"""OpenAI request bodies the facade accepts, validated with pydantic.

Unknown fields are ignored (clients send many we do not use); fields we cannot honour with a
different value than the default (``n > 1``, ``logprobs``, ``echo``, ``best_of``, ``suffix``) are
rejected with a clear message rather than answered as if honoured. Integers are bounded by the
protocol fields they travel in, so an out-of-range number is a 400, not a failure further in.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from kvmesh.common.wire.priority import Priority

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
INT64_MIN = -(2**63)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _only_default(default: object) -> Any:
    """A validator for a field kvmesh cannot honour: any value but ``default`` (or null) is refused."""

    def check(value: object) -> object:
        if value is not None and value != default:
            allowed = "" if default is None else f" or set it to {json.dumps(default)}"
            raise ValueError(f"not supported by kvmesh (leave it out{allowed})")
        return value

    return check


class StreamOptions(_Lenient):
    include_usage: bool = False


class MoeExpert(_Lenient):
    layer: Annotated[int, Field(ge=0, le=UINT32_MAX)]
    expert: Annotated[int, Field(ge=0, le=UINT32_MAX)]


class RouterConfigOverride(_Lenient):
    overlap_score_weight: Annotated[float, Field(ge=0)] | None = None
    router_temperature: Annotated[float, Field(ge=0)] | None = None
    # MoE models: the experts this request needs (workers that computed blocks with them gain score)
    moe_query: Annotated[list[MoeExpert], Field(max_length=4096)] | None = None


class KvmeshExtension(_Lenient):
    """kvmesh-specific routing hints, passed as the ``kvmesh`` object of the request body."""

    worker_id: Annotated[int, Field(ge=0, le=UINT64_MAX)] | None = None
    router_config_override: RouterConfigOverride | None = None
    expected_output_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX)] | None = None
    # the router queue's class while every worker is busy (the x-kvmesh-priority header wins)
    priority: Priority | None = None
    # the session (conversation, agent loop) it belongs to; wins over the session headers and ``user``
    session: str | None = None


class _SamplingRequest(_Lenient):
    model: str
    max_tokens: Annotated[int, Field(ge=1, le=UINT32_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=UINT64_MAX)] | None = None
    # vLLM's extension: generate max_tokens tokens even past the end-of-sequence token
    ignore_eos: bool = False
    # OpenAI's end-user id: taken as the request's session when nothing names one (kvmesh.session_of)
    user: str | None = None
    kvmesh: KvmeshExtension | None = None

    @field_validator("n")
    @classmethod
    def _single_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return stop

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=UINT32_MAX)] | None = None
    # no log-probabilities are computed: asking for them is refused, not answered without them
    logprobs: Annotated[bool | None, AfterValidator(_only_default(False))] = None
    top_logprobs: Annotated[int | None, AfterValidator(_only_default(0))] = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_SamplingRequest):
    prompt: str | Annotated[list[Annotated[int, Field(ge=0, le=UINT32_MAX)]], Field(min_length=1)]
    # refused unless left at what they would do anyway: nothing here computes them
    logprobs: Annotated[int | None, AfterValidator(_only_default(None))] = None
    echo: Annotated[bool | None, AfterValidator(_only_default(False))] = None
    best_of: Annotated[int | None, AfterValidator(_only_default(1))] = None
    suffix: Annotated[str | None, AfterValidator(_only_default(None))] = None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens
