from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JoinRequest(_message.Message):
    __slots__ = ("job", "world_size", "rank", "peer_address", "timeout_seconds", "host", "hostname", "elastic", "outbound_only", "max_world_size", "min_world_size", "moving_from", "rejoin", "punch_port")
    JOB_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_FIELD_NUMBER: _ClassVar[int]
    OUTBOUND_ONLY_FIELD_NUMBER: _ClassVar[int]
    MAX_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MIN_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MOVING_FROM_FIELD_NUMBER: _ClassVar[int]
    REJOIN_FIELD_NUMBER: _ClassVar[int]
    PUNCH_PORT_FIELD_NUMBER: _ClassVar[int]
    job: str
    world_size: int
    rank: int
    peer_address: str
    timeout_seconds: float
    host: str
    hostname: str
    elastic: bool
    outbound_only: bool
    max_world_size: int
    min_world_size: int
    moving_from: MovingFrom
    rejoin: Rejoin
    punch_port: int
    def __init__(self, job: _Optional[str] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., peer_address: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., host: _Optional[str] = ..., hostname: _Optional[str] = ..., elastic: _Optional[bool] = ..., outbound_only: _Optional[bool] = ..., max_world_size: _Optional[int] = ..., min_world_size: _Optional[int] = ..., moving_from: _Optional[_Union[MovingFrom, _Mapping]] = ..., rejoin: _Optional[_Union[Rejoin, _Mapping]] = ..., punch_port: _Optional[int] = ...) -> None: ...

class MovingFrom(_message.Message):
    __slots__ = ("generation", "rank", "member_id")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    generation: int
    rank: int
    member_id: str
    def __init__(self, generation: _Optional[int] = ..., rank: _Optional[int] = ..., member_id: _Optional[str] = ...) -> None: ...

class Position(_message.Message):
    __slots__ = ("generation", "boundary")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    generation: int
    boundary: int
    def __init__(self, generation: _Optional[int] = ..., boundary: _Optional[int] = ...) -> None: ...

class Rejoin(_message.Message):
    __slots__ = ("generation", "member_id", "next_seq", "pending", "retained", "away_seconds", "term")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    RETAINED_FIELD_NUMBER: _ClassVar[int]
    AWAY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    generation: int
    member_id: str
    next_seq: int
    pending: _containers.RepeatedScalarFieldContainer[int]
    retained: _containers.RepeatedScalarFieldContainer[int]
    away_seconds: float
    term: int
    def __init__(self, generation: _Optional[int] = ..., member_id: _Optional[str] = ..., next_seq: _Optional[int] = ..., pending: _Optional[_Iterable[int]] = ..., retained: _Optional[_Iterable[int]] = ..., away_seconds: _Optional[float] = ..., term: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("sent_unix_ms",)
    SENT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    sent_unix_ms: int
    def __init__(self, sent_unix_ms: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("join", "heartbeat", "leave", "boundaries", "position", "advance", "depart")
    JOIN_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    BOUNDARIES_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    ADVANCE_FIELD_NUMBER: _ClassVar[int]
    DEPART_FIELD_NUMBER: _ClassVar[int]
    join: JoinRequest
    heartbeat: Heartbeat
    leave: bool
    boundaries: bool
    position: Position
    advance: bool
    depart: bool
    def __init__(self, join: _Optional[_Union[JoinRequest, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., leave: _Optional[bool] = ..., boundaries: _Optional[bool] = ..., position: _Optional[_Union[Position, _Mapping]] = ..., advance: _Optional[bool] = ..., depart: _Optional[bool] = ...) -> None: ...

class Peer(_message.Message):
    __slots__ = ("rank", "address", "host", "hostname", "outbound_only", "punch")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    OUTBOUND_ONLY_FIELD_NUMBER: _ClassVar[int]
    PUNCH_FIELD_NUMBER: _ClassVar[int]
    rank: int
    address: str
    host: str
    hostname: str
    outbound_only: bool
    punch: str
    def __init__(self, rank: _Optional[int] = ..., address: _Optional[str] = ..., host: _Optional[str] = ..., hostname: _Optional[str] = ..., outbound_only: _Optional[bool] = ..., punch: _Optional[str] = ...) -> None: ...

class Joined(_message.Message):
    __slots__ = ("job", "generation", "rank", "world_size", "member_id", "peers", "heartbeat_interval_seconds", "shards", "peer_keys", "collectives", "replacement", "boundary", "newcomers", "min_world_size", "max_world_size", "resized", "replay", "term", "traversal")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    PEER_KEYS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_FIELD_NUMBER: _ClassVar[int]
    REPLACEMENT_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    NEWCOMERS_FIELD_NUMBER: _ClassVar[int]
    MIN_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESIZED_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    TRAVERSAL_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    rank: int
    world_size: int
    member_id: str
    peers: _containers.RepeatedCompositeFieldContainer[Peer]
    heartbeat_interval_seconds: float
    shards: _containers.RepeatedScalarFieldContainer[str]
    peer_keys: _containers.RepeatedScalarFieldContainer[bytes]
    collectives: str
    replacement: bool
    boundary: int
    newcomers: _containers.RepeatedScalarFieldContainer[int]
    min_world_size: int
    max_world_size: int
    resized: bool
    replay: _containers.RepeatedScalarFieldContainer[int]
    term: int
    traversal: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., member_id: _Optional[str] = ..., peers: _Optional[_Iterable[_Union[Peer, _Mapping]]] = ..., heartbeat_interval_seconds: _Optional[float] = ..., shards: _Optional[_Iterable[str]] = ..., peer_keys: _Optional[_Iterable[bytes]] = ..., collectives: _Optional[str] = ..., replacement: _Optional[bool] = ..., boundary: _Optional[int] = ..., newcomers: _Optional[_Iterable[int]] = ..., min_world_size: _Optional[int] = ..., max_world_size: _Optional[int] = ..., resized: _Optional[bool] = ..., replay: _Optional[_Iterable[int]] = ..., term: _Optional[int] = ..., traversal: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerationFailed(_message.Message):
    __slots__ = ("generation", "lost_rank", "reason", "error", "fields_json")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LOST_RANK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FIELDS_JSON_FIELD_NUMBER: _ClassVar[int]
    generation: int
    lost_rank: int
    reason: str
    error: str
    fields_json: str
    def __init__(self, generation: _Optional[int] = ..., lost_rank: _Optional[int] = ..., reason: _Optional[str] = ..., error: _Optional[str] = ..., fields_json: _Optional[str] = ...) -> None: ...

class RankFinished(_message.Message):
    __slots__ = ("generation", "rank", "reason")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    generation: int
    rank: int
    reason: str
    def __init__(self, generation: _Optional[int] = ..., rank: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ResizePending(_message.Message):
    __slots__ = ("generation", "joining", "departing", "refused")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    JOINING_FIELD_NUMBER: _ClassVar[int]
    DEPARTING_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    generation: int
    joining: int
    departing: _containers.RepeatedScalarFieldContainer[int]
    refused: str
    def __init__(self, generation: _Optional[int] = ..., joining: _Optional[int] = ..., departing: _Optional[_Iterable[int]] = ..., refused: _Optional[str] = ...) -> None: ...

class ResizeAt(_message.Message):
    __slots__ = ("generation", "boundary")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    generation: int
    boundary: int
    def __init__(self, generation: _Optional[int] = ..., boundary: _Optional[int] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("joined", "failed", "heartbeat_ack", "finished", "resize", "resize_at")
    JOINED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_ACK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    RESIZE_FIELD_NUMBER: _ClassVar[int]
    RESIZE_AT_FIELD_NUMBER: _ClassVar[int]
    joined: Joined
    failed: GenerationFailed
    heartbeat_ack: Heartbeat
    finished: RankFinished
    resize: ResizePending
    resize_at: ResizeAt
    def __init__(self, joined: _Optional[_Union[Joined, _Mapping]] = ..., failed: _Optional[_Union[GenerationFailed, _Mapping]] = ..., heartbeat_ack: _Optional[_Union[Heartbeat, _Mapping]] = ..., finished: _Optional[_Union[RankFinished, _Mapping]] = ..., resize: _Optional[_Union[ResizePending, _Mapping]] = ..., resize_at: _Optional[_Union[ResizeAt, _Mapping]] = ...) -> None: ...
