from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CollectiveOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COLLECTIVE_OP_UNSPECIFIED: _ClassVar[CollectiveOp]
    COLLECTIVE_OP_ALL_REDUCE: _ClassVar[CollectiveOp]
    COLLECTIVE_OP_BROADCAST: _ClassVar[CollectiveOp]
    COLLECTIVE_OP_ALL_GATHER: _ClassVar[CollectiveOp]
    COLLECTIVE_OP_REDUCE_SCATTER: _ClassVar[CollectiveOp]
    COLLECTIVE_OP_BARRIER: _ClassVar[CollectiveOp]
    COLLECTIVE_OP_ALL_TO_ALL: _ClassVar[CollectiveOp]

class ReduceOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REDUCE_OP_UNSPECIFIED: _ClassVar[ReduceOp]
    REDUCE_OP_SUM: _ClassVar[ReduceOp]
    REDUCE_OP_MEAN: _ClassVar[ReduceOp]
    REDUCE_OP_MIN: _ClassVar[ReduceOp]
    REDUCE_OP_MAX: _ClassVar[ReduceOp]
    REDUCE_OP_PROD: _ClassVar[ReduceOp]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]

class WireFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WIRE_FORMAT_UNSPECIFIED: _ClassVar[WireFormat]
    WIRE_FORMAT_BF16: _ClassVar[WireFormat]
    WIRE_FORMAT_FP16: _ClassVar[WireFormat]
    WIRE_FORMAT_INT8: _ClassVar[WireFormat]
    WIRE_FORMAT_INT4: _ClassVar[WireFormat]

class AveragingRule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AVERAGING_RULE_UNSPECIFIED: _ClassVar[AveragingRule]
    AVERAGING_RULE_SEED: _ClassVar[AveragingRule]
    AVERAGING_RULE_AVERAGE: _ClassVar[AveragingRule]
    AVERAGING_RULE_OUTER_SGD: _ClassVar[AveragingRule]
    AVERAGING_RULE_OUTER_NESTEROV: _ClassVar[AveragingRule]
COLLECTIVE_OP_UNSPECIFIED: CollectiveOp
COLLECTIVE_OP_ALL_REDUCE: CollectiveOp
COLLECTIVE_OP_BROADCAST: CollectiveOp
COLLECTIVE_OP_ALL_GATHER: CollectiveOp
COLLECTIVE_OP_REDUCE_SCATTER: CollectiveOp
COLLECTIVE_OP_BARRIER: CollectiveOp
COLLECTIVE_OP_ALL_TO_ALL: CollectiveOp
REDUCE_OP_UNSPECIFIED: ReduceOp
REDUCE_OP_SUM: ReduceOp
REDUCE_OP_MEAN: ReduceOp
REDUCE_OP_MIN: ReduceOp
REDUCE_OP_MAX: ReduceOp
REDUCE_OP_PROD: ReduceOp
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT64: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
WIRE_FORMAT_UNSPECIFIED: WireFormat
WIRE_FORMAT_BF16: WireFormat
WIRE_FORMAT_FP16: WireFormat
WIRE_FORMAT_INT8: WireFormat
WIRE_FORMAT_INT4: WireFormat
AVERAGING_RULE_UNSPECIFIED: AveragingRule
AVERAGING_RULE_SEED: AveragingRule
AVERAGING_RULE_AVERAGE: AveragingRule
AVERAGING_RULE_OUTER_SGD: AveragingRule
AVERAGING_RULE_OUTER_NESTEROV: AveragingRule

class AveragingSpec(_message.Message):
    __slots__ = ("model", "rule", "outer_lr", "outer_momentum")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    OUTER_LR_FIELD_NUMBER: _ClassVar[int]
    OUTER_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    model: str
    rule: AveragingRule
    outer_lr: float
    outer_momentum: float
    def __init__(self, model: _Optional[str] = ..., rule: _Optional[_Union[AveragingRule, str]] = ..., outer_lr: _Optional[float] = ..., outer_momentum: _Optional[float] = ...) -> None: ...

class CollectiveHeader(_message.Message):
    __slots__ = ("job", "generation", "group", "seq", "rank", "member_id", "op", "reduce_op", "dtype", "shape", "root", "chunk_bytes", "timeout_seconds", "averaging", "stripe", "stripes", "shm", "wire")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    REDUCE_OP_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AVERAGING_FIELD_NUMBER: _ClassVar[int]
    STRIPE_FIELD_NUMBER: _ClassVar[int]
    STRIPES_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    WIRE_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    group: str
    seq: int
    rank: int
    member_id: str
    op: CollectiveOp
    reduce_op: ReduceOp
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    root: int
    chunk_bytes: int
    timeout_seconds: float
    averaging: AveragingSpec
    stripe: int
    stripes: int
    shm: ShmSegment
    wire: WireFormat
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., group: _Optional[str] = ..., seq: _Optional[int] = ..., rank: _Optional[int] = ..., member_id: _Optional[str] = ..., op: _Optional[_Union[CollectiveOp, str]] = ..., reduce_op: _Optional[_Union[ReduceOp, str]] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., root: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., averaging: _Optional[_Union[AveragingSpec, _Mapping]] = ..., stripe: _Optional[int] = ..., stripes: _Optional[int] = ..., shm: _Optional[_Union[ShmSegment, _Mapping]] = ..., wire: _Optional[_Union[WireFormat, str]] = ...) -> None: ...

class ShmSegment(_message.Message):
    __slots__ = ("pid", "fd", "inode", "size", "output_offset", "key", "eager", "host")
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    INODE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    EAGER_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    pid: int
    fd: int
    inode: int
    size: int
    output_offset: int
    key: bytes
    eager: bool
    host: str
    def __init__(self, pid: _Optional[int] = ..., fd: _Optional[int] = ..., inode: _Optional[int] = ..., size: _Optional[int] = ..., output_offset: _Optional[int] = ..., key: _Optional[bytes] = ..., eager: _Optional[bool] = ..., host: _Optional[str] = ...) -> None: ...

class ShmAttach(_message.Message):
    __slots__ = ("attached", "reason")
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    attached: bool
    reason: str
    def __init__(self, attached: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class CollectiveAccept(_message.Message):
    __slots__ = ("output_chunks", "output_bytes")
    OUTPUT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    output_chunks: int
    output_bytes: int
    def __init__(self, output_chunks: _Optional[int] = ..., output_bytes: _Optional[int] = ...) -> None: ...

class CollectiveFailure(_message.Message):
    __slots__ = ("error", "fields_json", "message")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FIELDS_JSON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    error: str
    fields_json: str
    message: str
    def __init__(self, error: _Optional[str] = ..., fields_json: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class LateRank(_message.Message):
    __slots__ = ("rank", "lag_seconds")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    lag_seconds: float
    def __init__(self, rank: _Optional[int] = ..., lag_seconds: _Optional[float] = ...) -> None: ...

class CollectiveEnd(_message.Message):
    __slots__ = ("chunks", "bytes", "late")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    chunks: int
    bytes: int
    late: _containers.RepeatedCompositeFieldContainer[LateRank]
    def __init__(self, chunks: _Optional[int] = ..., bytes: _Optional[int] = ..., late: _Optional[_Iterable[_Union[LateRank, _Mapping]]] = ...) -> None: ...

class CollectiveFrame(_message.Message):
    __slots__ = ("frame",)
    FRAME_FIELD_NUMBER: _ClassVar[int]
    frame: bytes
    def __init__(self, frame: _Optional[bytes] = ...) -> None: ...
