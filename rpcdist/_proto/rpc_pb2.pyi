from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KIND_UNSPECIFIED: _ClassVar[Kind]
    CALL: _ClassVar[Kind]
    INTERNAL: _ClassVar[Kind]
    REPLY: _ClassVar[Kind]
    ERROR_REPLY: _ClassVar[Kind]
    P2P: _ClassVar[Kind]
KIND_UNSPECIFIED: Kind
CALL: Kind
INTERNAL: Kind
REPLY: Kind
ERROR_REPLY: Kind
P2P: Kind

class Frame(_message.Message):
    __slots__ = ("id", "kind", "first", "last", "method", "header", "buffer_sizes", "timeout_us", "data_len", "shm_path", "meta")
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SIZES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_US_FIELD_NUMBER: _ClassVar[int]
    DATA_LEN_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    id: int
    kind: Kind
    first: bool
    last: bool
    method: str
    header: bytes
    buffer_sizes: _containers.RepeatedScalarFieldContainer[int]
    timeout_us: int
    data_len: int
    shm_path: str
    meta: bytes
    def __init__(self, id: _Optional[int] = ..., kind: _Optional[_Union[Kind, str]] = ..., first: _Optional[bool] = ..., last: _Optional[bool] = ..., method: _Optional[str] = ..., header: _Optional[bytes] = ..., buffer_sizes: _Optional[_Iterable[int]] = ..., timeout_us: _Optional[int] = ..., data_len: _Optional[int] = ..., shm_path: _Optional[str] = ..., meta: _Optional[bytes] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[Frame]
    def __init__(self, frames: _Optional[_Iterable[_Union[Frame, _Mapping]]] = ...) -> None: ...
