from kvmesh.common.proto.kvmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OfferBlocksRequest(_message.Message):
    __slots__ = ("max_blocks", "skip", "list_only", "sequence_hashes")
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIELD_NUMBER: _ClassVar[int]
    LIST_ONLY_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_HASHES_FIELD_NUMBER: _ClassVar[int]
    max_blocks: int
    skip: _containers.RepeatedScalarFieldContainer[int]
    list_only: bool
    sequence_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, max_blocks: _Optional[int] = ..., skip: _Optional[_Iterable[int]] = ..., list_only: _Optional[bool] = ..., sequence_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class OfferedBlock(_message.Message):
    __slots__ = ("sequence_hash", "tokens_hash", "parent_hash")
    SEQUENCE_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    sequence_hash: int
    tokens_hash: int
    parent_hash: int
    def __init__(self, sequence_hash: _Optional[int] = ..., tokens_hash: _Optional[int] = ..., parent_hash: _Optional[int] = ...) -> None: ...

class BlockOffer(_message.Message):
    __slots__ = ("worker_id", "host", "port", "room", "blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    host: str
    port: int
    room: int
    blocks: _containers.RepeatedCompositeFieldContainer[OfferedBlock]
    def __init__(self, worker_id: _Optional[int] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., room: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[OfferedBlock, _Mapping]]] = ...) -> None: ...

class TakenBlocks(_message.Message):
    __slots__ = ("blocks", "bytes", "seconds")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    bytes: int
    seconds: float
    def __init__(self, blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class DumpKvStateRequest(_message.Message):
    __slots__ = ("dp_rank", "tier")
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    dp_rank: int
    tier: str
    def __init__(self, dp_rank: _Optional[int] = ..., tier: _Optional[str] = ...) -> None: ...

class CachedBlock(_message.Message):
    __slots__ = ("block_hash", "tokens_hash", "parent_hash", "sequence_hash")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_HASH_FIELD_NUMBER: _ClassVar[int]
    block_hash: int
    tokens_hash: int
    parent_hash: int
    sequence_hash: int
    def __init__(self, block_hash: _Optional[int] = ..., tokens_hash: _Optional[int] = ..., parent_hash: _Optional[int] = ..., sequence_hash: _Optional[int] = ...) -> None: ...

class KvStateDump(_message.Message):
    __slots__ = ("worker_id", "dp_rank", "last_event_id", "blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    dp_rank: int
    last_event_id: int
    blocks: _containers.RepeatedCompositeFieldContainer[CachedBlock]
    def __init__(self, worker_id: _Optional[int] = ..., dp_rank: _Optional[int] = ..., last_event_id: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[CachedBlock, _Mapping]]] = ...) -> None: ...

class WorkerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "model", "block_size", "total_blocks", "cached_blocks", "active_blocks", "running_requests", "waiting_requests", "kv_transfer_backend", "kv_transfers_in_flight", "held_prefills")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    HELD_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    model: str
    block_size: int
    total_blocks: int
    cached_blocks: int
    active_blocks: int
    running_requests: int
    waiting_requests: int
    kv_transfer_backend: str
    kv_transfers_in_flight: int
    held_prefills: int
    def __init__(self, worker_id: _Optional[int] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., total_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., active_blocks: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_transfer_backend: _Optional[str] = ..., kv_transfers_in_flight: _Optional[int] = ..., held_prefills: _Optional[int] = ...) -> None: ...
