from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason

class SamplingOptions(_message.Message):
    __slots__ = ("temperature", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class StopConditions(_message.Message):
    __slots__ = ("max_tokens", "stop_token_ids", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class RouterConfigOverride(_message.Message):
    __slots__ = ("overlap_score_weight", "router_temperature", "moe_query")
    OVERLAP_SCORE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    ROUTER_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    MOE_QUERY_FIELD_NUMBER: _ClassVar[int]
    overlap_score_weight: float
    router_temperature: float
    moe_query: _containers.RepeatedCompositeFieldContainer[MoeExpert]
    def __init__(self, overlap_score_weight: _Optional[float] = ..., router_temperature: _Optional[float] = ..., moe_query: _Optional[_Iterable[_Union[MoeExpert, _Mapping]]] = ...) -> None: ...

class MoeExpert(_message.Message):
    __slots__ = ("layer", "expert")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ...) -> None: ...

class RoutingHints(_message.Message):
    __slots__ = ("worker_id", "dp_rank", "router_config_override", "priority", "session_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    ROUTER_CONFIG_OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    dp_rank: int
    router_config_override: RouterConfigOverride
    priority: str
    session_id: str
    def __init__(self, worker_id: _Optional[int] = ..., dp_rank: _Optional[int] = ..., router_config_override: _Optional[_Union[RouterConfigOverride, _Mapping]] = ..., priority: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class PreprocessedRequest(_message.Message):
    __slots__ = ("request_id", "model", "token_ids", "sampling", "stop", "routing", "lora_name", "disaggregated_params", "expected_output_tokens", "whole_answer")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATED_PARAMS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WHOLE_ANSWER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingOptions
    stop: StopConditions
    routing: RoutingHints
    lora_name: str
    disaggregated_params: bytes
    expected_output_tokens: int
    whole_answer: bool
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., stop: _Optional[_Union[StopConditions, _Mapping]] = ..., routing: _Optional[_Union[RoutingHints, _Mapping]] = ..., lora_name: _Optional[str] = ..., disaggregated_params: _Optional[bytes] = ..., expected_output_tokens: _Optional[int] = ..., whole_answer: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateOutput(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "usage", "disaggregated_params", "worker_id", "dp_rank")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATED_PARAMS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    disaggregated_params: bytes
    worker_id: int
    dp_rank: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., disaggregated_params: _Optional[bytes] = ..., worker_id: _Optional[int] = ..., dp_rank: _Optional[int] = ...) -> None: ...

class GenerateCommand(_message.Message):
    __slots__ = ("submit", "cancel", "attach", "forward")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    submit: PreprocessedRequest
    cancel: str
    attach: str
    forward: Forward
    def __init__(self, submit: _Optional[_Union[PreprocessedRequest, _Mapping]] = ..., cancel: _Optional[str] = ..., attach: _Optional[str] = ..., forward: _Optional[_Union[Forward, _Mapping]] = ...) -> None: ...

class Forward(_message.Message):
    __slots__ = ("request", "frontend_id")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    request: PreprocessedRequest
    frontend_id: str
    def __init__(self, request: _Optional[_Union[PreprocessedRequest, _Mapping]] = ..., frontend_id: _Optional[str] = ...) -> None: ...

class GenerateCommands(_message.Message):
    __slots__ = ("commands",)
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    commands: _containers.RepeatedCompositeFieldContainer[GenerateCommand]
    def __init__(self, commands: _Optional[_Iterable[_Union[GenerateCommand, _Mapping]]] = ...) -> None: ...

class RequestEnd(_message.Message):
    __slots__ = ("code", "details", "origin", "retry_after_secs")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_SECS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    origin: str
    retry_after_secs: int
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., origin: _Optional[str] = ..., retry_after_secs: _Optional[int] = ...) -> None: ...

class StreamItem(_message.Message):
    __slots__ = ("request_id", "output", "end")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    output: GenerateOutput
    end: RequestEnd
    def __init__(self, request_id: _Optional[str] = ..., output: _Optional[_Union[GenerateOutput, _Mapping]] = ..., end: _Optional[_Union[RequestEnd, _Mapping]] = ...) -> None: ...

class GenerateBatch(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[StreamItem]
    def __init__(self, items: _Optional[_Iterable[_Union[StreamItem, _Mapping]]] = ...) -> None: ...
