"""What a rank learns of its job's stragglers (the hub measures them:
``gradstar.coordinator.metrics.arrivals``).

Two ways, both off the hot path:

- **In its log** (:class:`StragglerLog`). The hub's ``END`` of a collective names the ranks
  that collective waited for (``CollectiveEnd.late``: those at least 5 ms behind the first
  rank, the latest 8, only on stripe 0; empty, so free, when the ranks kept in step). When
  one of them is at least ``straggler_log_seconds`` late (``GRADSTAR_STRAGGLER_LOG_SECONDS``,
  0.5 s by default), the rank logs one warning naming them and their hosts, then stays quiet
  for ``straggler_log_window`` seconds (``GRADSTAR_STRAGGLER_LOG_WINDOW``, 60 by default),
  counting what it left out; the next line says how many. Every rank logs it, the late ones
  too (a rank rarely knows it is the slow one).
- **On request** (:func:`fetch_stragglers`, behind ``ProcessGroup.straggler_stats``): the
  job's whole summary from the coordinator (``Admin.GetStragglers``, which the job token
  opens), for a training loop or a Lightning callback to log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import grpc

from gradstar.proto.v1 import admin_pb2 as apb
from gradstar.proto.v1 import admin_pb2_grpc
from gradstar.transport.addresses import split_host_port
from gradstar.transport.status import error_from_rpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankStragglerStats:
    """One rank's arrivals at its job's collectives (lags in seconds after the first rank)."""

    rank: int
    host: str
    address: str
    collectives: int
    #: Exponentially weighted mean lag (recent collectives count most): the ranks' order.
    ewma_lag_seconds: float
    median_lag_seconds: float
    p95_lag_seconds: float
    mean_lag_seconds: float
    last_lag_seconds: float
    max_lag_seconds: float
    #: Collectives it arrived last in, and their share of its collectives.
    last_arrivals: int
    last_share: float
    #: Seconds the others waited for it alone, summed.
    waited_seconds: float
    #: Whether it stands out as a straggler.
    flagged: bool


@dataclass(frozen=True)
class StragglerStats:
    """A job's arrival summary: ``ranks`` slowest first (of ``ranks_total`` measured)."""

    job: str
    ranks: tuple[RankStragglerStats, ...]
    ranks_total: int

    @property
    def stragglers(self) -> tuple[RankStragglerStats, ...]:
        """The ranks flagged as stragglers, slowest first."""
        return tuple(r for r in self.ranks if r.flagged)

    def as_dict(self) -> dict:
        """Plain data (for a logger or ``json.dumps``)."""
        return {"job": self.job, "ranks_total": self.ranks_total,
                "ranks": [asdict(r) for r in self.ranks]}


def stats_from_reply(reply: apb.GetStragglersResponse) -> StragglerStats:
    fields = RankStragglerStats.__dataclass_fields__
    return StragglerStats(reply.job, tuple(
        RankStragglerStats(**{name: getattr(r, name) for name in fields}) for r in reply.ranks),
        reply.ranks_total)


async def fetch_stragglers(channel: grpc.aio.Channel, metadata, job: str, *, limit: int = 0,
                           timeout: float = 10.0, target: str = "") -> StragglerStats:
    """``job``'s arrival summary from the coordinator behind ``channel``.

    Raises:
        CoordinatorUnavailableError, AuthenticationError, GradstarError: the call failed.
    """
    stub = admin_pb2_grpc.AdminStub(channel)
    try:
        reply = await stub.GetStragglers(apb.GetStragglersRequest(job=job, limit=limit),
                                         metadata=metadata, timeout=timeout)
    except grpc.RpcError as error:
        raise error_from_rpc(error, f"reading the stragglers of job {job!r}", target) from None
    return stats_from_reply(reply)


def peer_hosts(peers: Iterable) -> dict[int, str]:
    """rank -> what to call its host, from a ``Joined``'s peers: its host name, else its
    peer server's host, else its host key."""
    return {p.rank: p.hostname or split_host_port(p.address)[0] or p.host for p in peers}


class StragglerLog:
    """The rank's rate-limited log line about collectives that waited for some ranks."""

    @classmethod
    def for_group(cls, settings, joined) -> StragglerLog:
        """The log of the group that ``joined`` (a ``Joined``) with ``settings``."""
        return cls(f"job {joined.job!r}", peer_hosts(joined.peers),
                   settings.straggler_log_seconds, settings.straggler_log_window)

    def __init__(self, what: str, hosts: dict[int, str], threshold: float, window: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        #: What the group is called in the line ("job 'j'").
        self.what = what
        self.hosts = hosts
        self.threshold = threshold
        self.window = window
        self.clock = clock
        self._next = 0.0
        #: Collectives past the threshold left out of the log since its last line.
        self.quiet = 0

    def saw(self, seq: int, late: Iterable) -> None:
        """Collective ``seq`` ended; ``late`` (``LateRank``\\ s, latest first) are the ranks
        it waited for. Logs them if one is past the threshold and the window allows."""
        if self.threshold <= 0:
            return
        over = [r for r in late if r.lag_seconds >= self.threshold]
        if not over:
            return
        now = self.clock()
        if now < self._next:
            self.quiet += 1
            return
        self._next = now + self.window
        names = "; ".join(f"rank {r.rank} (host {self.hosts.get(r.rank) or '?'}) "
                          f"{r.lag_seconds:.3g} s late" for r in over)
        more = (f" ({self.quiet} more collective{'s' if self.quiet != 1 else ''} waited "
                f"over {self.threshold:g} s since the last such line)" if self.quiet else "")
        self.quiet = 0
        log.warning("collective seq %d of %s waited for %s%s; next such line in %g s at the "
                    "earliest (straggler_log_window)", seq, self.what, names, more, self.window)
