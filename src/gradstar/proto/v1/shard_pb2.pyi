from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardHello(_message.Message):
    __slots__ = ("address", "slot", "job", "host", "outbound_only", "punch_port")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    OUTBOUND_ONLY_FIELD_NUMBER: _ClassVar[int]
    PUNCH_PORT_FIELD_NUMBER: _ClassVar[int]
    address: str
    slot: int
    job: str
    host: str
    outbound_only: bool
    punch_port: int
    def __init__(self, address: _Optional[str] = ..., slot: _Optional[int] = ..., job: _Optional[str] = ..., host: _Optional[str] = ..., outbound_only: _Optional[bool] = ..., punch_port: _Optional[int] = ...) -> None: ...

class ShardJob(_message.Message):
    __slots__ = ("job", "bytes_in", "bytes_out", "completed", "failed", "active")
    class CompletedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    class FailedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    job: str
    bytes_in: int
    bytes_out: int
    completed: _containers.ScalarMap[int, int]
    failed: _containers.ScalarMap[int, int]
    active: bool
    def __init__(self, job: _Optional[str] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., completed: _Optional[_Mapping[int, int]] = ..., failed: _Optional[_Mapping[int, int]] = ..., active: _Optional[bool] = ...) -> None: ...

class RankArrivals(_message.Message):
    __slots__ = ("job", "rank", "collectives", "last", "lag_sum_seconds", "lag_ewma_seconds", "last_lag_seconds", "max_lag_seconds", "cost_seconds", "buckets", "min_lag_seconds")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    LAG_SUM_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAG_EWMA_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    MIN_LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    collectives: int
    last: int
    lag_sum_seconds: float
    lag_ewma_seconds: float
    last_lag_seconds: float
    max_lag_seconds: float
    cost_seconds: float
    buckets: _containers.RepeatedScalarFieldContainer[int]
    min_lag_seconds: float
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., collectives: _Optional[int] = ..., last: _Optional[int] = ..., lag_sum_seconds: _Optional[float] = ..., lag_ewma_seconds: _Optional[float] = ..., last_lag_seconds: _Optional[float] = ..., max_lag_seconds: _Optional[float] = ..., cost_seconds: _Optional[float] = ..., buckets: _Optional[_Iterable[int]] = ..., min_lag_seconds: _Optional[float] = ...) -> None: ...

class ShardStats(_message.Message):
    __slots__ = ("bytes_in", "bytes_out", "jobs", "arrivals")
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    ARRIVALS_FIELD_NUMBER: _ClassVar[int]
    bytes_in: int
    bytes_out: int
    jobs: _containers.RepeatedCompositeFieldContainer[ShardJob]
    arrivals: _containers.RepeatedCompositeFieldContainer[RankArrivals]
    def __init__(self, bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., jobs: _Optional[_Iterable[_Union[ShardJob, _Mapping]]] = ..., arrivals: _Optional[_Iterable[_Union[RankArrivals, _Mapping]]] = ...) -> None: ...

class ShardReport(_message.Message):
    __slots__ = ("hello", "stats")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    hello: ShardHello
    stats: ShardStats
    def __init__(self, hello: _Optional[_Union[ShardHello, _Mapping]] = ..., stats: _Optional[_Union[ShardStats, _Mapping]] = ...) -> None: ...

class ShardAccepted(_message.Message):
    __slots__ = ("slot", "stats_interval_seconds")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    STATS_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    stats_interval_seconds: float
    def __init__(self, slot: _Optional[int] = ..., stats_interval_seconds: _Optional[float] = ...) -> None: ...

class GenerationMember(_message.Message):
    __slots__ = ("rank", "member_id")
    RANK_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    member_id: str
    def __init__(self, rank: _Optional[int] = ..., member_id: _Optional[str] = ...) -> None: ...

class GenerationFormed(_message.Message):
    __slots__ = ("job", "generation", "world_size", "members", "shards", "position")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    world_size: int
    members: _containers.RepeatedCompositeFieldContainer[GenerationMember]
    shards: int
    position: int
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., world_size: _Optional[int] = ..., members: _Optional[_Iterable[_Union[GenerationMember, _Mapping]]] = ..., shards: _Optional[int] = ..., position: _Optional[int] = ...) -> None: ...

class GenerationOver(_message.Message):
    __slots__ = ("job", "generation", "error", "fields_json", "message")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FIELDS_JSON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    error: str
    fields_json: str
    message: str
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., error: _Optional[str] = ..., fields_json: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ShardPunch(_message.Message):
    __slots__ = ("host", "port")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...

class ShardCommand(_message.Message):
    __slots__ = ("accepted", "formed", "over", "punch")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FORMED_FIELD_NUMBER: _ClassVar[int]
    OVER_FIELD_NUMBER: _ClassVar[int]
    PUNCH_FIELD_NUMBER: _ClassVar[int]
    accepted: ShardAccepted
    formed: GenerationFormed
    over: GenerationOver
    punch: ShardPunch
    def __init__(self, accepted: _Optional[_Union[ShardAccepted, _Mapping]] = ..., formed: _Optional[_Union[GenerationFormed, _Mapping]] = ..., over: _Optional[_Union[GenerationOver, _Mapping]] = ..., punch: _Optional[_Union[ShardPunch, _Mapping]] = ...) -> None: ...
