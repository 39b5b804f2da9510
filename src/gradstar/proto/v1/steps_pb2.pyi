from gradstar.proto.v1 import collective_pb2 as _collective_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SyncModeKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SYNC_MODE_UNSPECIFIED: _ClassVar[SyncModeKind]
    SYNC_MODE_SYNCHRONOUS: _ClassVar[SyncModeKind]
    SYNC_MODE_QUORUM: _ClassVar[SyncModeKind]
    SYNC_MODE_BOUNDED_STALENESS: _ClassVar[SyncModeKind]
    SYNC_MODE_ASYNCHRONOUS: _ClassVar[SyncModeKind]

class StepScaling(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_SCALING_UNSPECIFIED: _ClassVar[StepScaling]
    STEP_SCALING_PLAIN: _ClassVar[StepScaling]
    STEP_SCALING_SHARE: _ClassVar[StepScaling]
    STEP_SCALING_STALENESS: _ClassVar[StepScaling]
    STEP_SCALING_SHARE_STALENESS: _ClassVar[StepScaling]
SYNC_MODE_UNSPECIFIED: SyncModeKind
SYNC_MODE_SYNCHRONOUS: SyncModeKind
SYNC_MODE_QUORUM: SyncModeKind
SYNC_MODE_BOUNDED_STALENESS: SyncModeKind
SYNC_MODE_ASYNCHRONOUS: SyncModeKind
STEP_SCALING_UNSPECIFIED: StepScaling
STEP_SCALING_PLAIN: StepScaling
STEP_SCALING_SHARE: StepScaling
STEP_SCALING_STALENESS: StepScaling
STEP_SCALING_SHARE_STALENESS: StepScaling

class SyncMode(_message.Message):
    __slots__ = ("kind", "min_ranks", "timeout_seconds", "adaptive_timeout", "max_staleness", "scaling")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MIN_RANKS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    SCALING_FIELD_NUMBER: _ClassVar[int]
    kind: SyncModeKind
    min_ranks: int
    timeout_seconds: float
    adaptive_timeout: bool
    max_staleness: int
    scaling: StepScaling
    def __init__(self, kind: _Optional[_Union[SyncModeKind, str]] = ..., min_ranks: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., adaptive_timeout: _Optional[bool] = ..., max_staleness: _Optional[int] = ..., scaling: _Optional[_Union[StepScaling, str]] = ...) -> None: ...

class StepsKey(_message.Message):
    __slots__ = ("job", "model", "rank", "world_size", "generation", "member_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    model: str
    rank: int
    world_size: int
    generation: int
    member_id: str
    def __init__(self, job: _Optional[str] = ..., model: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., generation: _Optional[int] = ..., member_id: _Optional[str] = ...) -> None: ...

class ContributionHeader(_message.Message):
    __slots__ = ("key", "mode", "mode_epoch", "numel", "base", "weight", "wire", "fetch_limit", "await_step", "wait_seconds", "hyper", "buffer_numel", "streamed")
    KEY_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MODE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIRE_FIELD_NUMBER: _ClassVar[int]
    FETCH_LIMIT_FIELD_NUMBER: _ClassVar[int]
    AWAIT_STEP_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HYPER_FIELD_NUMBER: _ClassVar[int]
    BUFFER_NUMEL_FIELD_NUMBER: _ClassVar[int]
    STREAMED_FIELD_NUMBER: _ClassVar[int]
    key: StepsKey
    mode: SyncMode
    mode_epoch: int
    numel: int
    base: int
    weight: float
    wire: _collective_pb2.WireFormat
    fetch_limit: int
    await_step: bool
    wait_seconds: float
    hyper: _containers.RepeatedScalarFieldContainer[float]
    buffer_numel: int
    streamed: bool
    def __init__(self, key: _Optional[_Union[StepsKey, _Mapping]] = ..., mode: _Optional[_Union[SyncMode, _Mapping]] = ..., mode_epoch: _Optional[int] = ..., numel: _Optional[int] = ..., base: _Optional[int] = ..., weight: _Optional[float] = ..., wire: _Optional[_Union[_collective_pb2.WireFormat, str]] = ..., fetch_limit: _Optional[int] = ..., await_step: _Optional[bool] = ..., wait_seconds: _Optional[float] = ..., hyper: _Optional[_Iterable[float]] = ..., buffer_numel: _Optional[int] = ..., streamed: _Optional[bool] = ...) -> None: ...

class ContributionPart(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ContributionHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ContributionHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Contributed(_message.Message):
    __slots__ = ("accepted", "step", "staleness", "steps", "reason", "want_snapshot", "waited_seconds")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WANT_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    WAITED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    step: int
    staleness: int
    steps: int
    reason: str
    want_snapshot: bool
    waited_seconds: float
    def __init__(self, accepted: _Optional[bool] = ..., step: _Optional[int] = ..., staleness: _Optional[int] = ..., steps: _Optional[int] = ..., reason: _Optional[str] = ..., want_snapshot: _Optional[bool] = ..., waited_seconds: _Optional[float] = ...) -> None: ...

class FetchStepsRequest(_message.Message):
    __slots__ = ("key", "have", "min_steps", "wait_seconds", "limit")
    KEY_FIELD_NUMBER: _ClassVar[int]
    HAVE_FIELD_NUMBER: _ClassVar[int]
    MIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    key: StepsKey
    have: int
    min_steps: int
    wait_seconds: float
    limit: int
    def __init__(self, key: _Optional[_Union[StepsKey, _Mapping]] = ..., have: _Optional[int] = ..., min_steps: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., limit: _Optional[int] = ...) -> None: ...

class StepRecord(_message.Message):
    __slots__ = ("step", "ranks", "weights", "staleness", "hyper", "factors")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    HYPER_FIELD_NUMBER: _ClassVar[int]
    FACTORS_FIELD_NUMBER: _ClassVar[int]
    step: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    weights: _containers.RepeatedScalarFieldContainer[float]
    staleness: _containers.RepeatedScalarFieldContainer[int]
    hyper: _containers.RepeatedScalarFieldContainer[float]
    factors: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, step: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ..., weights: _Optional[_Iterable[float]] = ..., staleness: _Optional[_Iterable[int]] = ..., hyper: _Optional[_Iterable[float]] = ..., factors: _Optional[_Iterable[float]] = ...) -> None: ...

class StepsHeader(_message.Message):
    __slots__ = ("ready", "steps", "numel", "records", "wire", "contributed")
    READY_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    WIRE_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTED_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    steps: int
    numel: int
    records: _containers.RepeatedCompositeFieldContainer[StepRecord]
    wire: _collective_pb2.WireFormat
    contributed: Contributed
    def __init__(self, ready: _Optional[bool] = ..., steps: _Optional[int] = ..., numel: _Optional[int] = ..., records: _Optional[_Iterable[_Union[StepRecord, _Mapping]]] = ..., wire: _Optional[_Union[_collective_pb2.WireFormat, str]] = ..., contributed: _Optional[_Union[Contributed, _Mapping]] = ...) -> None: ...

class StepsPart(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: StepsHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[StepsHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class StepsHeartbeat(_message.Message):
    __slots__ = ("key", "have", "leave")
    KEY_FIELD_NUMBER: _ClassVar[int]
    HAVE_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    key: StepsKey
    have: int
    leave: bool
    def __init__(self, key: _Optional[_Union[StepsKey, _Mapping]] = ..., have: _Optional[int] = ..., leave: _Optional[bool] = ...) -> None: ...

class StepsState(_message.Message):
    __slots__ = ("steps", "live", "has_snapshot", "snapshot_steps")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    HAS_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    live: _containers.RepeatedScalarFieldContainer[int]
    has_snapshot: bool
    snapshot_steps: int
    def __init__(self, steps: _Optional[int] = ..., live: _Optional[_Iterable[int]] = ..., has_snapshot: _Optional[bool] = ..., snapshot_steps: _Optional[int] = ...) -> None: ...

class SynchronizeRequest(_message.Message):
    __slots__ = ("key", "barrier", "wait_seconds", "next_mode")
    KEY_FIELD_NUMBER: _ClassVar[int]
    BARRIER_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_MODE_FIELD_NUMBER: _ClassVar[int]
    key: StepsKey
    barrier: int
    wait_seconds: float
    next_mode: SyncMode
    def __init__(self, key: _Optional[_Union[StepsKey, _Mapping]] = ..., barrier: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., next_mode: _Optional[_Union[SyncMode, _Mapping]] = ...) -> None: ...

class SynchronizeReply(_message.Message):
    __slots__ = ("ready", "steps", "mode", "mode_epoch", "switch_refused")
    READY_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MODE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SWITCH_REFUSED_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    steps: int
    mode: SyncMode
    mode_epoch: int
    switch_refused: str
    def __init__(self, ready: _Optional[bool] = ..., steps: _Optional[int] = ..., mode: _Optional[_Union[SyncMode, _Mapping]] = ..., mode_epoch: _Optional[int] = ..., switch_refused: _Optional[str] = ...) -> None: ...

class SnapshotHeader(_message.Message):
    __slots__ = ("key", "steps", "layout", "nbytes", "mode_epoch", "barriers")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    MODE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BARRIERS_FIELD_NUMBER: _ClassVar[int]
    key: StepsKey
    steps: int
    layout: str
    nbytes: int
    mode_epoch: int
    barriers: int
    def __init__(self, key: _Optional[_Union[StepsKey, _Mapping]] = ..., steps: _Optional[int] = ..., layout: _Optional[str] = ..., nbytes: _Optional[int] = ..., mode_epoch: _Optional[int] = ..., barriers: _Optional[int] = ...) -> None: ...

class SnapshotPart(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: SnapshotHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[SnapshotHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("key", "wait_seconds")
    KEY_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    key: StepsKey
    wait_seconds: float
    def __init__(self, key: _Optional[_Union[StepsKey, _Mapping]] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("key", "have", "barriers", "mode_epoch", "wait_seconds")
    KEY_FIELD_NUMBER: _ClassVar[int]
    HAVE_FIELD_NUMBER: _ClassVar[int]
    BARRIERS_FIELD_NUMBER: _ClassVar[int]
    MODE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    key: StepsKey
    have: int
    barriers: int
    mode_epoch: int
    wait_seconds: float
    def __init__(self, key: _Optional[_Union[StepsKey, _Mapping]] = ..., have: _Optional[int] = ..., barriers: _Optional[int] = ..., mode_epoch: _Optional[int] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class ResumeReply(_message.Message):
    __slots__ = ("ready", "steps", "load_snapshot", "send_snapshot")
    READY_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SEND_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    steps: int
    load_snapshot: bool
    send_snapshot: bool
    def __init__(self, ready: _Optional[bool] = ..., steps: _Optional[int] = ..., load_snapshot: _Optional[bool] = ..., send_snapshot: _Optional[bool] = ...) -> None: ...
