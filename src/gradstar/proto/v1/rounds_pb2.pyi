from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RoundsKey(_message.Message):
    __slots__ = ("job", "model", "fragment", "replica")
    JOB_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    job: str
    model: str
    fragment: int
    replica: str
    def __init__(self, job: _Optional[str] = ..., model: _Optional[str] = ..., fragment: _Optional[int] = ..., replica: _Optional[str] = ...) -> None: ...

class RoundPolicy(_message.Message):
    __slots__ = ("outer_lr", "outer_momentum", "nesterov", "min_replicas", "round_timeout_seconds")
    OUTER_LR_FIELD_NUMBER: _ClassVar[int]
    OUTER_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    MIN_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ROUND_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    outer_lr: float
    outer_momentum: float
    nesterov: bool
    min_replicas: int
    round_timeout_seconds: float
    def __init__(self, outer_lr: _Optional[float] = ..., outer_momentum: _Optional[float] = ..., nesterov: _Optional[bool] = ..., min_replicas: _Optional[int] = ..., round_timeout_seconds: _Optional[float] = ...) -> None: ...

class TensorHeader(_message.Message):
    __slots__ = ("key", "numel", "round", "policy", "wire_format")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    WIRE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    key: RoundsKey
    numel: int
    round: int
    policy: RoundPolicy
    wire_format: str
    def __init__(self, key: _Optional[_Union[RoundsKey, _Mapping]] = ..., numel: _Optional[int] = ..., round: _Optional[int] = ..., policy: _Optional[_Union[RoundPolicy, _Mapping]] = ..., wire_format: _Optional[str] = ...) -> None: ...

class TensorPart(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: TensorHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[TensorHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class RoundStatus(_message.Message):
    __slots__ = ("rounds", "accepted", "numel", "bulk_address")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    BULK_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    accepted: bool
    numel: int
    bulk_address: str
    def __init__(self, rounds: _Optional[int] = ..., accepted: _Optional[bool] = ..., numel: _Optional[int] = ..., bulk_address: _Optional[str] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("key", "min_rounds", "wait_seconds")
    KEY_FIELD_NUMBER: _ClassVar[int]
    MIN_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    key: RoundsKey
    min_rounds: int
    wait_seconds: float
    def __init__(self, key: _Optional[_Union[RoundsKey, _Mapping]] = ..., min_rounds: _Optional[int] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class FetchHeader(_message.Message):
    __slots__ = ("ready", "rounds", "numel", "holds_contribution")
    READY_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    HOLDS_CONTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    rounds: int
    numel: int
    holds_contribution: bool
    def __init__(self, ready: _Optional[bool] = ..., rounds: _Optional[int] = ..., numel: _Optional[int] = ..., holds_contribution: _Optional[bool] = ...) -> None: ...

class FetchPart(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: FetchHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[FetchHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...
