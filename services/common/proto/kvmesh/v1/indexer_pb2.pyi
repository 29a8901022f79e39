from kvmesh.common.proto.kvmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class IndexerStatusRequest(_message.Message):
    __slots__ = ("include_digests",)
    INCLUDE_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    include_digests: bool
    def __init__(self, include_digests: _Optional[bool] = ...) -> None: ...

class IndexedWorker(_message.Message):
    __slots__ = ("worker_id", "dp_rank", "blocks", "last_event_id", "recovering", "blocks_digest", "tier", "in_transit_blocks", "evicted_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    RECOVERING_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    IN_TRANSIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    dp_rank: int
    blocks: int
    last_event_id: int
    recovering: bool
    blocks_digest: int
    tier: str
    in_transit_blocks: int
    evicted_blocks: int
    def __init__(self, worker_id: _Optional[int] = ..., dp_rank: _Optional[int] = ..., blocks: _Optional[int] = ..., last_event_id: _Optional[int] = ..., recovering: _Optional[bool] = ..., blocks_digest: _Optional[int] = ..., tier: _Optional[str] = ..., in_transit_blocks: _Optional[int] = ..., evicted_blocks: _Optional[int] = ...) -> None: ...

class IndexerStatus(_message.Message):
    __slots__ = ("replica_id", "applied_sequence", "stream_last_sequence", "workers", "events_applied", "gaps", "recoveries", "snapshot_sequence", "snapshots_taken", "lag_messages")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    APPLIED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STREAM_LAST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    GAPS_FIELD_NUMBER: _ClassVar[int]
    RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_TAKEN_FIELD_NUMBER: _ClassVar[int]
    LAG_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    applied_sequence: int
    stream_last_sequence: int
    workers: _containers.RepeatedCompositeFieldContainer[IndexedWorker]
    events_applied: int
    gaps: int
    recoveries: int
    snapshot_sequence: int
    snapshots_taken: int
    lag_messages: int
    def __init__(self, replica_id: _Optional[str] = ..., applied_sequence: _Optional[int] = ..., stream_last_sequence: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[IndexedWorker, _Mapping]]] = ..., events_applied: _Optional[int] = ..., gaps: _Optional[int] = ..., recoveries: _Optional[int] = ..., snapshot_sequence: _Optional[int] = ..., snapshots_taken: _Optional[int] = ..., lag_messages: _Optional[int] = ...) -> None: ...

class FindMatchesRequest(_message.Message):
    __slots__ = ("local_hashes", "sequence_hashes", "moe_query")
    LOCAL_HASHES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_HASHES_FIELD_NUMBER: _ClassVar[int]
    MOE_QUERY_FIELD_NUMBER: _ClassVar[int]
    local_hashes: _containers.RepeatedScalarFieldContainer[int]
    sequence_hashes: _containers.RepeatedScalarFieldContainer[int]
    moe_query: _containers.RepeatedCompositeFieldContainer[_common_pb2.MoeExpert]
    def __init__(self, local_hashes: _Optional[_Iterable[int]] = ..., sequence_hashes: _Optional[_Iterable[int]] = ..., moe_query: _Optional[_Iterable[_Union[_common_pb2.MoeExpert, _Mapping]]] = ...) -> None: ...

class FindMatchesQuery(_message.Message):
    __slots__ = ("query_id", "request")
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    query_id: int
    request: FindMatchesRequest
    def __init__(self, query_id: _Optional[int] = ..., request: _Optional[_Union[FindMatchesRequest, _Mapping]] = ...) -> None: ...

class FindMatchesQueries(_message.Message):
    __slots__ = ("queries",)
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    queries: _containers.RepeatedCompositeFieldContainer[FindMatchesQuery]
    def __init__(self, queries: _Optional[_Iterable[_Union[FindMatchesQuery, _Mapping]]] = ...) -> None: ...

class FindMatchesAnswer(_message.Message):
    __slots__ = ("query_id", "response", "refused")
    QUERY_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    query_id: int
    response: FindMatchesResponse
    refused: str
    def __init__(self, query_id: _Optional[int] = ..., response: _Optional[_Union[FindMatchesResponse, _Mapping]] = ..., refused: _Optional[str] = ...) -> None: ...

class FindMatchesAnswers(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[FindMatchesAnswer]
    def __init__(self, answers: _Optional[_Iterable[_Union[FindMatchesAnswer, _Mapping]]] = ...) -> None: ...

class WorkerMatch(_message.Message):
    __slots__ = ("worker_id", "dp_rank", "matched_blocks", "total_blocks", "moe_aligned_blocks", "moe_hosted_experts", "pooled_blocks", "host_blocks", "disk_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MOE_ALIGNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MOE_HOSTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    POOLED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    dp_rank: int
    matched_blocks: int
    total_blocks: int
    moe_aligned_blocks: int
    moe_hosted_experts: int
    pooled_blocks: int
    host_blocks: int
    disk_blocks: int
    def __init__(self, worker_id: _Optional[int] = ..., dp_rank: _Optional[int] = ..., matched_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., moe_aligned_blocks: _Optional[int] = ..., moe_hosted_experts: _Optional[int] = ..., pooled_blocks: _Optional[int] = ..., host_blocks: _Optional[int] = ..., disk_blocks: _Optional[int] = ...) -> None: ...

class FindMatchesResponse(_message.Message):
    __slots__ = ("workers", "applied_sequence")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerMatch]
    applied_sequence: int
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerMatch, _Mapping]]] = ..., applied_sequence: _Optional[int] = ...) -> None: ...
