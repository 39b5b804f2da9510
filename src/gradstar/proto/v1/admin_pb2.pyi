from gradstar.proto.v1 import collective_pb2 as _collective_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListJobsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class JobSummary(_message.Message):
    __slots__ = ("job", "generation", "world_size", "members", "state", "min_world_size", "max_world_size", "resizes", "joining_at_boundary", "departing_at_boundary")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MIN_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESIZES_FIELD_NUMBER: _ClassVar[int]
    JOINING_AT_BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    DEPARTING_AT_BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    world_size: int
    members: int
    state: str
    min_world_size: int
    max_world_size: int
    resizes: int
    joining_at_boundary: int
    departing_at_boundary: int
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., world_size: _Optional[int] = ..., members: _Optional[int] = ..., state: _Optional[str] = ..., min_world_size: _Optional[int] = ..., max_world_size: _Optional[int] = ..., resizes: _Optional[int] = ..., joining_at_boundary: _Optional[int] = ..., departing_at_boundary: _Optional[int] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobSummary]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobSummary, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("rank", "peer_address", "last_heartbeat_age_seconds")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    peer_address: str
    last_heartbeat_age_seconds: float
    def __init__(self, rank: _Optional[int] = ..., peer_address: _Optional[str] = ..., last_heartbeat_age_seconds: _Optional[float] = ...) -> None: ...

class InFlightCollective(_message.Message):
    __slots__ = ("seq", "group", "op", "arrived_ranks", "missing_ranks", "age_seconds")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_RANKS_FIELD_NUMBER: _ClassVar[int]
    MISSING_RANKS_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    group: str
    op: _collective_pb2.CollectiveOp
    arrived_ranks: _containers.RepeatedScalarFieldContainer[int]
    missing_ranks: _containers.RepeatedScalarFieldContainer[int]
    age_seconds: float
    def __init__(self, seq: _Optional[int] = ..., group: _Optional[str] = ..., op: _Optional[_Union[_collective_pb2.CollectiveOp, str]] = ..., arrived_ranks: _Optional[_Iterable[int]] = ..., missing_ranks: _Optional[_Iterable[int]] = ..., age_seconds: _Optional[float] = ...) -> None: ...

class OpCounter(_message.Message):
    __slots__ = ("op", "completed", "failed")
    OP_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    op: _collective_pb2.CollectiveOp
    completed: int
    failed: int
    def __init__(self, op: _Optional[_Union[_collective_pb2.CollectiveOp, str]] = ..., completed: _Optional[int] = ..., failed: _Optional[int] = ...) -> None: ...

class GlobalModel(_message.Message):
    __slots__ = ("name", "rounds", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    rounds: int
    parameters: int
    def __init__(self, name: _Optional[str] = ..., rounds: _Optional[int] = ..., parameters: _Optional[int] = ...) -> None: ...

class GetJobResponse(_message.Message):
    __slots__ = ("summary", "members", "in_flight", "ops", "bytes_in", "bytes_out", "last_failure", "models", "rebuilds", "rejoin_wait_seconds")
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILURE_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    REBUILDS_FIELD_NUMBER: _ClassVar[int]
    REJOIN_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    summary: JobSummary
    members: _containers.RepeatedCompositeFieldContainer[Member]
    in_flight: _containers.RepeatedCompositeFieldContainer[InFlightCollective]
    ops: _containers.RepeatedCompositeFieldContainer[OpCounter]
    bytes_in: int
    bytes_out: int
    last_failure: str
    models: _containers.RepeatedCompositeFieldContainer[GlobalModel]
    rebuilds: int
    rejoin_wait_seconds: float
    def __init__(self, summary: _Optional[_Union[JobSummary, _Mapping]] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., in_flight: _Optional[_Iterable[_Union[InFlightCollective, _Mapping]]] = ..., ops: _Optional[_Iterable[_Union[OpCounter, _Mapping]]] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., last_failure: _Optional[str] = ..., models: _Optional[_Iterable[_Union[GlobalModel, _Mapping]]] = ..., rebuilds: _Optional[int] = ..., rejoin_wait_seconds: _Optional[float] = ...) -> None: ...

class ListShardsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShardSummary(_message.Message):
    __slots__ = ("slot", "address", "state", "bytes_in", "bytes_out", "jobs", "last_report_age_seconds")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    LAST_REPORT_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    address: str
    state: str
    bytes_in: int
    bytes_out: int
    jobs: _containers.RepeatedScalarFieldContainer[str]
    last_report_age_seconds: float
    def __init__(self, slot: _Optional[int] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., jobs: _Optional[_Iterable[str]] = ..., last_report_age_seconds: _Optional[float] = ...) -> None: ...

class ListShardsResponse(_message.Message):
    __slots__ = ("shards", "expected")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardSummary]
    expected: int
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardSummary, _Mapping]]] = ..., expected: _Optional[int] = ...) -> None: ...

class ListRoundsRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class RoundsFragment(_message.Message):
    __slots__ = ("model", "fragment", "rounds", "parameters", "last_participants", "last_missed", "open_contributions")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    LAST_PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    LAST_MISSED_FIELD_NUMBER: _ClassVar[int]
    OPEN_CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    fragment: int
    rounds: int
    parameters: int
    last_participants: _containers.RepeatedScalarFieldContainer[str]
    last_missed: _containers.RepeatedScalarFieldContainer[str]
    open_contributions: int
    def __init__(self, model: _Optional[str] = ..., fragment: _Optional[int] = ..., rounds: _Optional[int] = ..., parameters: _Optional[int] = ..., last_participants: _Optional[_Iterable[str]] = ..., last_missed: _Optional[_Iterable[str]] = ..., open_contributions: _Optional[int] = ...) -> None: ...

class RoundsReplica(_message.Message):
    __slots__ = ("replica", "joins", "contributed", "missed", "late", "last_seen_age_seconds")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    JOINS_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTED_FIELD_NUMBER: _ClassVar[int]
    MISSED_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    replica: str
    joins: int
    contributed: int
    missed: int
    late: int
    last_seen_age_seconds: float
    def __init__(self, replica: _Optional[str] = ..., joins: _Optional[int] = ..., contributed: _Optional[int] = ..., missed: _Optional[int] = ..., late: _Optional[int] = ..., last_seen_age_seconds: _Optional[float] = ...) -> None: ...

class ListRoundsResponse(_message.Message):
    __slots__ = ("fragments", "replicas")
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    fragments: _containers.RepeatedCompositeFieldContainer[RoundsFragment]
    replicas: _containers.RepeatedCompositeFieldContainer[RoundsReplica]
    def __init__(self, fragments: _Optional[_Iterable[_Union[RoundsFragment, _Mapping]]] = ..., replicas: _Optional[_Iterable[_Union[RoundsReplica, _Mapping]]] = ...) -> None: ...

class ListStepsRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class StepsRankView(_message.Message):
    __slots__ = ("rank", "live", "base", "contributed", "dropped")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    live: bool
    base: int
    contributed: int
    dropped: int
    def __init__(self, rank: _Optional[int] = ..., live: _Optional[bool] = ..., base: _Optional[int] = ..., contributed: _Optional[int] = ..., dropped: _Optional[int] = ...) -> None: ...

class StepsModelView(_message.Message):
    __slots__ = ("model", "mode", "steps", "world_size", "live", "dropped", "staleness", "ranks", "snapshot_steps")
    class StalenessEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_STEPS_FIELD_NUMBER: _ClassVar[int]
    model: str
    mode: str
    steps: int
    world_size: int
    live: _containers.RepeatedScalarFieldContainer[int]
    dropped: int
    staleness: _containers.ScalarMap[int, int]
    ranks: _containers.RepeatedCompositeFieldContainer[StepsRankView]
    snapshot_steps: int
    def __init__(self, model: _Optional[str] = ..., mode: _Optional[str] = ..., steps: _Optional[int] = ..., world_size: _Optional[int] = ..., live: _Optional[_Iterable[int]] = ..., dropped: _Optional[int] = ..., staleness: _Optional[_Mapping[int, int]] = ..., ranks: _Optional[_Iterable[_Union[StepsRankView, _Mapping]]] = ..., snapshot_steps: _Optional[int] = ...) -> None: ...

class ListStepsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[StepsModelView]
    def __init__(self, models: _Optional[_Iterable[_Union[StepsModelView, _Mapping]]] = ...) -> None: ...

class GetStragglersRequest(_message.Message):
    __slots__ = ("job", "limit")
    JOB_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    job: str
    limit: int
    def __init__(self, job: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class RankStragglerStats(_message.Message):
    __slots__ = ("rank", "host", "address", "collectives", "ewma_lag_seconds", "median_lag_seconds", "p95_lag_seconds", "mean_lag_seconds", "last_lag_seconds", "max_lag_seconds", "last_arrivals", "last_share", "waited_seconds", "flagged")
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_FIELD_NUMBER: _ClassVar[int]
    EWMA_LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEDIAN_LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    P95_LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_ARRIVALS_FIELD_NUMBER: _ClassVar[int]
    LAST_SHARE_FIELD_NUMBER: _ClassVar[int]
    WAITED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FLAGGED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    host: str
    address: str
    collectives: int
    ewma_lag_seconds: float
    median_lag_seconds: float
    p95_lag_seconds: float
    mean_lag_seconds: float
    last_lag_seconds: float
    max_lag_seconds: float
    last_arrivals: int
    last_share: float
    waited_seconds: float
    flagged: bool
    def __init__(self, rank: _Optional[int] = ..., host: _Optional[str] = ..., address: _Optional[str] = ..., collectives: _Optional[int] = ..., ewma_lag_seconds: _Optional[float] = ..., median_lag_seconds: _Optional[float] = ..., p95_lag_seconds: _Optional[float] = ..., mean_lag_seconds: _Optional[float] = ..., last_lag_seconds: _Optional[float] = ..., max_lag_seconds: _Optional[float] = ..., last_arrivals: _Optional[int] = ..., last_share: _Optional[float] = ..., waited_seconds: _Optional[float] = ..., flagged: _Optional[bool] = ...) -> None: ...

class GetStragglersResponse(_message.Message):
    __slots__ = ("job", "ranks", "ranks_total")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    RANKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    job: str
    ranks: _containers.RepeatedCompositeFieldContainer[RankStragglerStats]
    ranks_total: int
    def __init__(self, job: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[RankStragglerStats, _Mapping]]] = ..., ranks_total: _Optional[int] = ...) -> None: ...

class GetLeadershipRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLeadershipResponse(_message.Message):
    __slots__ = ("elected", "role", "address", "leader", "term", "leader_since_unix", "takeovers", "rejoin_wait_seconds", "rebuilds")
    ELECTED_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    LEADER_SINCE_UNIX_FIELD_NUMBER: _ClassVar[int]
    TAKEOVERS_FIELD_NUMBER: _ClassVar[int]
    REJOIN_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REBUILDS_FIELD_NUMBER: _ClassVar[int]
    elected: bool
    role: str
    address: str
    leader: str
    term: int
    leader_since_unix: float
    takeovers: int
    rejoin_wait_seconds: float
    rebuilds: int
    def __init__(self, elected: _Optional[bool] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., leader: _Optional[str] = ..., term: _Optional[int] = ..., leader_since_unix: _Optional[float] = ..., takeovers: _Optional[int] = ..., rejoin_wait_seconds: _Optional[float] = ..., rebuilds: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("active_jobs",)
    ACTIVE_JOBS_FIELD_NUMBER: _ClassVar[int]
    active_jobs: int
    def __init__(self, active_jobs: _Optional[int] = ...) -> None: ...
