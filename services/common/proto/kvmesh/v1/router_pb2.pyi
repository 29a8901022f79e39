from kvmesh.common.proto.kvmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RoutingQuery(_message.Message):
    __slots__ = ("model", "token_ids", "lora_name", "router_config_override", "expected_output_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    ROUTER_CONFIG_OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    lora_name: str
    router_config_override: _common_pb2.RouterConfigOverride
    expected_output_tokens: int
    def __init__(self, model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., lora_name: _Optional[str] = ..., router_config_override: _Optional[_Union[_common_pb2.RouterConfigOverride, _Mapping]] = ..., expected_output_tokens: _Optional[int] = ...) -> None: ...

class BestWorkerResponse(_message.Message):
    __slots__ = ("worker_id", "dp_rank", "overlap_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    dp_rank: int
    overlap_blocks: int
    def __init__(self, worker_id: _Optional[int] = ..., dp_rank: _Optional[int] = ..., overlap_blocks: _Optional[int] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("worker_id", "dp_rank", "overlap_blocks", "potential_prefill_tokens", "potential_decode_blocks", "active_prefill_tokens", "active_decode_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    POTENTIAL_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POTENTIAL_DECODE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_DECODE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    dp_rank: int
    overlap_blocks: int
    potential_prefill_tokens: int
    potential_decode_blocks: int
    active_prefill_tokens: int
    active_decode_blocks: int
    def __init__(self, worker_id: _Optional[int] = ..., dp_rank: _Optional[int] = ..., overlap_blocks: _Optional[int] = ..., potential_prefill_tokens: _Optional[int] = ..., potential_decode_blocks: _Optional[int] = ..., active_prefill_tokens: _Optional[int] = ..., active_decode_blocks: _Optional[int] = ...) -> None: ...

class PotentialLoadsResponse(_message.Message):
    __slots__ = ("loads",)
    LOADS_FIELD_NUMBER: _ClassVar[int]
    loads: _containers.RepeatedCompositeFieldContainer[WorkerLoad]
    def __init__(self, loads: _Optional[_Iterable[_Union[WorkerLoad, _Mapping]]] = ...) -> None: ...
