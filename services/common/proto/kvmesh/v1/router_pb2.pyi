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

class RouteRequest(_message.Message):
    __slots__ = ("request", "migration", "forward_to")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_FIELD_NUMBER: _ClassVar[int]
    FORWARD_TO_FIELD_NUMBER: _ClassVar[int]
    request: _common_pb2.PreprocessedRequest
    migration: int
    forward_to: str
    def __init__(self, request: _Optional[_Union[_common_pb2.PreprocessedRequest, _Mapping]] = ..., migration: _Optional[int] = ..., forward_to: _Optional[str] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("worker_id", "worker_address", "overlap_blocks", "router_id", "migration_limit", "forced", "forward_lost", "disaggregated_params", "dp_rank")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_LIMIT_FIELD_NUMBER: _ClassVar[int]
    FORCED_FIELD_NUMBER: _ClassVar[int]
    FORWARD_LOST_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATED_PARAMS_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    worker_address: str
    overlap_blocks: int
    router_id: str
    migration_limit: int
    forced: bool
    forward_lost: bool
    disaggregated_params: bytes
    dp_rank: int
    def __init__(self, worker_id: _Optional[int] = ..., worker_address: _Optional[str] = ..., overlap_blocks: _Optional[int] = ..., router_id: _Optional[str] = ..., migration_limit: _Optional[int] = ..., forced: _Optional[bool] = ..., forward_lost: _Optional[bool] = ..., disaggregated_params: _Optional[bytes] = ..., dp_rank: _Optional[int] = ...) -> None: ...

class RouteQuery(_message.Message):
    __slots__ = ("query_id", "request")
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    query_id: int
    request: RouteRequest
    def __init__(self, query_id: _Optional[int] = ..., request: _Optional[_Union[RouteRequest, _Mapping]] = ...) -> None: ...

class RouteQueries(_message.Message):
    __slots__ = ("queries", "reports")
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    queries: _containers.RepeatedCompositeFieldContainer[RouteQuery]
    reports: bytes
    def __init__(self, queries: _Optional[_Iterable[_Union[RouteQuery, _Mapping]]] = ..., reports: _Optional[bytes] = ...) -> None: ...

class RouteAnswer(_message.Message):
    __slots__ = ("query_id", "response", "refused")
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    query_id: int
    response: RouteResponse
    refused: _common_pb2.RequestEnd
    def __init__(self, query_id: _Optional[int] = ..., response: _Optional[_Union[RouteResponse, _Mapping]] = ..., refused: _Optional[_Union[_common_pb2.RequestEnd, _Mapping]] = ...) -> None: ...

class RouteAnswers(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[RouteAnswer]
    def __init__(self, answers: _Optional[_Iterable[_Union[RouteAnswer, _Mapping]]] = ...) -> None: ...

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

class RouterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RouterStatus(_message.Message):
    __slots__ = ("router_id", "mode", "replica_sync", "sync_peers", "loads", "active_requests", "outcome_window_seconds", "recent_outcomes", "total_outcomes", "migrations", "queued", "misconfigurations", "sessions", "recent_sessions")
    class RecentOutcomesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TotalOutcomesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class QueuedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_SYNC_FIELD_NUMBER: _ClassVar[int]
    SYNC_PEERS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECENT_OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    MISCONFIGURATIONS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RECENT_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    mode: str
    replica_sync: bool
    sync_peers: int
    loads: _containers.RepeatedCompositeFieldContainer[WorkerLoad]
    active_requests: int
    outcome_window_seconds: int
    recent_outcomes: _containers.ScalarMap[str, int]
    total_outcomes: _containers.ScalarMap[str, int]
    migrations: int
    queued: _containers.ScalarMap[str, int]
    misconfigurations: _containers.RepeatedScalarFieldContainer[str]
    sessions: int
    recent_sessions: _containers.RepeatedCompositeFieldContainer[SessionAffinity]
    def __init__(self, router_id: _Optional[str] = ..., mode: _Optional[str] = ..., replica_sync: _Optional[bool] = ..., sync_peers: _Optional[int] = ..., loads: _Optional[_Iterable[_Union[WorkerLoad, _Mapping]]] = ..., active_requests: _Optional[int] = ..., outcome_window_seconds: _Optional[int] = ..., recent_outcomes: _Optional[_Mapping[str, int]] = ..., total_outcomes: _Optional[_Mapping[str, int]] = ..., migrations: _Optional[int] = ..., queued: _Optional[_Mapping[str, int]] = ..., misconfigurations: _Optional[_Iterable[str]] = ..., sessions: _Optional[int] = ..., recent_sessions: _Optional[_Iterable[_Union[SessionAffinity, _Mapping]]] = ...) -> None: ...

class SessionAffinity(_message.Message):
    __slots__ = ("session_id", "worker_id", "dp_rank", "expires_in_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    worker_id: int
    dp_rank: int
    expires_in_s: float
    def __init__(self, session_id: _Optional[str] = ..., worker_id: _Optional[int] = ..., dp_rank: _Optional[int] = ..., expires_in_s: _Optional[float] = ...) -> None: ...
