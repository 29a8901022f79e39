from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FindMatchesRequest(_message.Message):
    __slots__ = ("local_hashes", "sequence_hashes")
    LOCAL_HASHES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_HASHES_FIELD_NUMBER: _ClassVar[int]
    local_hashes: _containers.RepeatedScalarFieldContainer[int]
    sequence_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, local_hashes: _Optional[_Iterable[int]] = ..., sequence_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerMatch(_message.Message):
    __slots__ = ("worker_id", "dp_rank", "matched_blocks", "total_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    dp_rank: int
    matched_blocks: int
    total_blocks: int
    def __init__(self, worker_id: _Optional[int] = ..., dp_rank: _Optional[int] = ..., matched_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ...) -> None: ...

class FindMatchesResponse(_message.Message):
    __slots__ = ("workers", "applied_sequence")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerMatch]
    applied_sequence: int
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerMatch, _Mapping]]] = ..., applied_sequence: _Optional[int] = ...) -> None: ...
