"""One coordinator of several leads, elected through an etcd lease (``gradstar coordinator
--ha etcd://HOST:PORT``); the others stand by and serve no job.

The protocol, every step one etcd call (:mod:`.etcd`):

1. Each coordinator holds a lease of ``ttl`` seconds and keeps it alive.
2. It tries to create the election key ``<prefix>/leader`` bound to its lease, in one
   transaction that succeeds only if the key does not exist. The one that creates it leads;
   its **term** is the etcd revision that created the key, which only grows, so every later
   leader has a higher one. The others read the key (the leader's address, term and since
   when), and try again every ``ttl / 5`` seconds (at most 1 s).
3. The leader renews its lease every ``ttl / 4`` seconds. It counts as leader only until its
   last renewal was *sent* plus the TTL etcd granted, less a margin (:meth:`Leadership.valid`,
   on its own monotonic clock): etcd can let the lease expire no earlier, so no standby can
   have won before then. A leader that was stopped (SIGSTOP) or cut off past that time knows
   at once when it runs again, before it answers anything: it is **fenced** for good
   (:attr:`Role.FENCED`), serves nothing and writes nothing (its memory is stale; restart the
   process to make it a standby again).
4. A standby that creates the key once the lease expired takes over; the ranks rejoin it as
   they rejoin a restarted coordinator (:mod:`gradstar.coordinator.rendezvous.rebuild`),
   carrying the highest term they have seen: a coordinator that sees a higher term than its
   own in a rejoin refuses it, and is fenced too once etcd confirms that another leads (a
   rank's word alone never fences it: one job's rank must not stop every job's coordinator).

An orderly stop revokes the lease, so that a standby takes over at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import time
from collections.abc import Callable

from gradstar.errors import ElectionUnavailableError, NotLeaderError, StaleCoordinatorError

from .etcd import Etcd, KeyValue

log = logging.getLogger(__name__)

#: The part of the TTL a leader leaves as margin when it decides alone whether it still leads
#: (clock rates differ a little between hosts; etcd's own expiry is later still).
MARGIN = 0.2


class Role(enum.Enum):
    STANDBY = "standby"
    LEADER = "leader"
    #: Lost its lease (or saw a newer term): it serves nothing any more.
    FENCED = "fenced"


class Leadership:
    """This coordinator's part in the election (the module docstring says how it goes).

    ``on_elected()`` runs once it leads, ``on_fenced(reason)`` once it lost the lead for good;
    :meth:`check` is what every call that serves a job asks first.
    """

    def __init__(self, etcd: Etcd, prefix: str, address: str, ttl: int, *,
                 on_elected: Callable[[], None] = lambda: None,
                 on_fenced: Callable[[str], None] = lambda reason: None) -> None:
        self._etcd = etcd
        self.key = f"{prefix}/leader"
        self._history = f"{prefix}/terms/"
        self.address = address
        self.ttl = ttl
        self._on_elected = on_elected
        self._on_fenced = on_fenced
        self.role = Role.STANDBY
        #: The leader as last read from etcd (this one once it leads): address, term, since.
        self.leader = ""
        self.term = 0
        self.since = 0.0
        #: Leaderships after the first in this election's history (each one a takeover).
        self.takeovers = 0
        self.fenced_because = ""
        self._lease = 0
        self._valid_until = 0.0
        self._task: asyncio.Task | None = None
        self._checks: set[asyncio.Task] = set()  # _verify tasks (the loop holds them weakly)

    async def connect(self) -> None:
        """Take a lease (before anything binds, so that an etcd out of reach is named first).

        Raises:
            ElectionUnavailableError: etcd cannot be reached (within its request timeout).
        """
        self._lease = await self._call(self._etcd.grant, self.ttl)

    async def start(self, address: str) -> None:
        """Campaign as the coordinator at ``address`` (in the background, after a first try,
        so that it starts as the leader or knowing who leads).

        Raises:
            ElectionUnavailableError: etcd cannot be reached (within its request timeout).
        """
        self.address = address
        await self._campaign()
        self._task = asyncio.create_task(self._run(), name="gradstar-election")

    async def stop(self) -> None:
        """Stop campaigning and revoke the lease: a leader's, so that a standby takes over
        now (a standby's holds no key, but need not wait out its TTL in etcd)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._lease and self.role is not Role.FENCED:
            with contextlib.suppress(ElectionUnavailableError):
                await self._call(self._etcd.revoke, self._lease)
        if self.role is not Role.FENCED:
            self.role, self.fenced_because = Role.FENCED, "it stopped"

    @property
    def poll(self) -> float:
        """Seconds between a standby's tries at the key: a fifth of the TTL, at most 1 s (so
        that a revoked lease, an orderly stop, is taken over within a second)."""
        return min(max(self.ttl / 5, 0.2), 1.0)

    def valid(self) -> bool:
        """Whether this coordinator leads now, by its own clock (see the module)."""
        return self.role is Role.LEADER and time.monotonic() < self._valid_until

    def check(self, seen: int = 0) -> int:
        """This coordinator's term, if it may serve a call from a rank that has seen term
        ``seen``.

        Raises:
            NotLeaderError: it is a standby, or its lease ran out (then it is fenced).
            StaleCoordinatorError: ``seen`` is newer than its term: another took over (it is
                fenced once etcd confirms it), or the rank is wrong.
        """
        if self.role is Role.LEADER and not self.valid():
            self._fence(f"its lease of {self.ttl} s ran out before it could renew it (this "
                        "process was stopped, starved or cut off from etcd)")
        if self.role is not Role.LEADER:
            raise NotLeaderError(
                f"the coordinator at {self.address} is {self._state()}; "
                + (f"the leader is at {self.leader} (term {self.term})" if self.leader
                   else "no leader is elected yet"), leader=self.leader, term=self.term)
        if seen > self.term:
            # Asked of etcd before it fences itself: a rank's word alone (a bug, or a rank of
            # one job that lies) must not take the coordinator away from every job.
            task = asyncio.get_running_loop().create_task(self._verify(seen))
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)
            raise StaleCoordinatorError(
                f"the coordinator at {self.address} leads in term {self.term}, but the rank has "
                f"seen term {seen}: another coordinator took over since, or the rank is wrong; "
                "it does not serve this rank", term=self.term, seen=seen)
        return self.term

    async def _verify(self, seen: int) -> None:
        """A rank said it saw term ``seen``, newer than this leader's: fenced if etcd names
        another leader, else the claim was false (and refused)."""
        try:
            kv = await self._call(self._etcd.get, self.key)
        except ElectionUnavailableError as error:
            log.warning("election: cannot check a rank's term %d against etcd: %s", seen, error)
            return
        if kv is None or kv.create_revision != self.term or kv.lease != self._lease:
            self._fence(f"a rank has seen term {seen}, and etcd no longer names this "
                        f"coordinator's term {self.term} as the leader's")
        else:
            log.warning("election: a rank claimed term %d, which this election never had "
                        "(the leader's is %d); it was refused", seen, self.term)

    def guard(self) -> None:
        """:meth:`check` for a write to the shared ``--state-dir``: a coordinator that does not
        lead writes nothing there."""
        self.check()

    def _state(self) -> str:
        if self.role is Role.FENCED:
            return f"fenced ({self.fenced_because}) and serves no job"
        return "a standby and serves no job"

    async def _call(self, method, *args):
        return await asyncio.to_thread(method, *args)

    async def _run(self) -> None:
        while self.role is not Role.FENCED:
            try:
                if self.role is Role.STANDBY:
                    await self._campaign()
                    await asyncio.sleep(self.poll)
                else:
                    sent = time.monotonic()
                    left = await self._call(self._etcd.keepalive, self._lease)
                    if left <= 0:
                        self._fence("etcd let its lease expire")
                        return
                    self._valid_until = sent + left - MARGIN * self.ttl
                    await asyncio.sleep(self.ttl / 4)
            except ElectionUnavailableError as error:
                if self.role is Role.LEADER and not self.valid():
                    self._fence(f"etcd could not be reached to renew its lease: {error}")
                    return
                log.warning("election: %s", error)
                await asyncio.sleep(min(self.ttl / 5, 1.0))

    async def _campaign(self) -> None:
        """One try at the election key; a standby keeps its own lease alive meanwhile (a new
        one if it expired, say after this process was stopped)."""
        sent = time.monotonic()
        if await self._call(self._etcd.keepalive, self._lease) <= 0:
            self._lease = await self._call(self._etcd.grant, self.ttl)
        since = time.time()
        value = json.dumps({"address": self.address, "since": since})
        created = await self._call(self._etcd.create, self.key, value, self._lease)
        if not created.made:
            self._heard(created.kv)
            return
        self._valid_until = sent + self.ttl - MARGIN * self.ttl
        self.role, self.leader, self.term, self.since = (Role.LEADER, self.address,
                                                         created.revision, since)
        await self._call(self._etcd.put, f"{self._history}{self.term:020d}", value)
        self.takeovers = max(await self._call(self._etcd.count, self._history) - 1, 0)
        log.warning("election: this coordinator (%s) leads, term %d (takeovers so far: %d)",
                    self.address, self.term, self.takeovers)
        self._on_elected()

    def _heard(self, kv: KeyValue | None) -> None:
        if kv is None:
            return
        try:
            value = json.loads(kv.value)
            leader, since = str(value["address"]), float(value["since"])
        except (ValueError, KeyError, TypeError):
            leader, since = kv.value, 0.0
        if kv.create_revision != self.term:
            log.info("election: the leader is %s (term %d)", leader, kv.create_revision)
        self.leader, self.term, self.since = leader, kv.create_revision, since

    def _fence(self, reason: str) -> None:
        if self.role is Role.FENCED:
            return
        was = self.role
        self.role, self.fenced_because = Role.FENCED, reason
        log.error("election: this coordinator (%s, term %d) no longer leads: %s; it serves "
                  "nothing from now on", self.address, self.term, reason)
        if was is Role.LEADER:
            self._on_fenced(reason)


__all__ = ["MARGIN", "Leadership", "Role"]
