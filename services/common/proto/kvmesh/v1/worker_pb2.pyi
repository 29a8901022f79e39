from services.common.proto.kvmesh.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "model", "block_size", "total_blocks", "cached_blocks", "active_blocks", "running_requests", "waiting_requests")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    model: str
    block_size: int
    total_blocks: int
    cached_blocks: int
    active_blocks: int
    running_requests: int
    waiting_requests: int
    def __init__(self, worker_id: _Optional[int] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., total_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., active_blocks: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ...) -> None: ...
