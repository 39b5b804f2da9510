from gradstar.proto.v1 import collective_pb2 as _collective_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ArrayKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ARRAY_KIND_UNSPECIFIED: _ClassVar[ArrayKind]
    ARRAY_KIND_NUMPY: _ClassVar[ArrayKind]
    ARRAY_KIND_TORCH: _ClassVar[ArrayKind]
ARRAY_KIND_UNSPECIFIED: ArrayKind
ARRAY_KIND_NUMPY: ArrayKind
ARRAY_KIND_TORCH: ArrayKind

class PeerHello(_message.Message):
    __slots__ = ("job", "generation", "src_rank", "dst_rank", "nonce", "proof")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    src_rank: int
    dst_rank: int
    nonce: bytes
    proof: bytes
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., src_rank: _Optional[int] = ..., dst_rank: _Optional[int] = ..., nonce: _Optional[bytes] = ..., proof: _Optional[bytes] = ...) -> None: ...

class PeerAccept(_message.Message):
    __slots__ = ("rank", "generation")
    RANK_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    generation: int
    def __init__(self, rank: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class PeerMessageHeader(_message.Message):
    __slots__ = ("seq", "tag", "dtype", "shape", "chunk_bytes", "array_kind")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARRAY_KIND_FIELD_NUMBER: _ClassVar[int]
    seq: int
    tag: str
    dtype: _collective_pb2.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    chunk_bytes: int
    array_kind: ArrayKind
    def __init__(self, seq: _Optional[int] = ..., tag: _Optional[str] = ..., dtype: _Optional[_Union[_collective_pb2.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., chunk_bytes: _Optional[int] = ..., array_kind: _Optional[_Union[ArrayKind, str]] = ...) -> None: ...

class PeerAck(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class PeerFrame(_message.Message):
    __slots__ = ("frame",)
    FRAME_FIELD_NUMBER: _ClassVar[int]
    frame: bytes
    def __init__(self, frame: _Optional[bytes] = ...) -> None: ...
