"""Fault-tolerant outer rounds: the hub's side of DiLoCo and Streaming DiLoCo replicas.

A *fragment* is one flat float32 slice of a job's global model, keyed by (job, model,
fragment); a plain DiLoCo model is fragment 0. Replicas are named processes (or replica groups)
that never form a generation: each talks to this table alone.

Protocol, per fragment:

1. **Seed** (a replica starts or restarts): the first seed stores its parameters as the global
   model at round 0; later seeds only check the size. The replica is *active* from now on and
   its join is counted. It then fetches the global model and its round count ``r``.
2. **Contribute** ``(replica, round r, pseudo-gradient)``: taken into round ``r`` if ``r`` is
   the round now open (or the next one, which this contribution opens); answered
   ``accepted=False`` if round ``r`` already closed without it (the replica fetches the current
   global model and contributes to the next round). A round from the future, a wrong size or
   a policy unlike the round's raises :class:`RoundMismatchError`.
3. **Close**: a round closes as soon as every replica that was active when it opened has
   contributed and at least ``min_replicas`` did, or at its deadline (``round_timeout`` after
   it opened) once at least ``min_replicas`` did. Below ``min_replicas`` it stays open: a
   replica that arrives (or restarts) completes it, and waiting replicas see their own
   timeouts. Expected replicas that did not contribute are *missed*: counted, and inactive
   until they seed or contribute again, so the next rounds do not wait for a dead replica.
4. **Outer step**, exactly once per round: the mean of the contributions, summed in replica
   name order in float32 (so the result does not depend on arrival order), is the outer
   gradient; outer SGD or Nesterov (:class:`.averaging.AveragingRound`) updates the global
   fragment, and the new model is persisted with ``--state-dir`` before anyone can fetch it.

Every contribution is held whole until its round closes; a replica that dies mid-stream never
reaches this table (the servicer takes only complete vectors), so no partial data is summed.
Nothing here does I/O but the averaging store's persistence; time comes from ``clock``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from gradstar.errors import HubCapacityError, RoundMismatchError
from gradstar.proto.v1 import collective_pb2 as cpb

from .averaging import AveragingStore, GlobalModel

log = logging.getLogger(__name__)

#: Closed rounds remembered per fragment (for the admin view and the status page).
HISTORY = 32


@dataclass(frozen=True)
class Policy:
    """How a round combines contributions; every contribution to a round carries the same."""

    outer_lr: float
    outer_momentum: float
    nesterov: bool
    min_replicas: int
    round_timeout: float


@dataclass
class ReplicaRecord:
    """What the hub knows of one replica of a job."""

    joins: int = 0
    contributed: int = 0
    missed: int = 0
    late: int = 0
    last_seen: float = 0.0
    #: Expected in rounds that open from now on (false once it missed one).
    active: bool = False
    #: (model, fragment) seeded since its last join: seeding one again means a restart.
    seeded: set = field(default_factory=set)


@dataclass(frozen=True)
class ClosedRound:
    number: int
    participants: tuple[str, ...]
    missed: tuple[str, ...]
    closed_at: float


@dataclass
class OpenRound:
    number: int
    policy: Policy
    deadline: float
    expected: frozenset[str]
    contributions: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class Fragment:
    """One fragment's round state (its global model lives in the averaging store)."""

    numel: int
    open: OpenRound | None = None
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY))


class RoundsTable:
    """Every job's fragments and replicas; the servicer's only state.

    ``on_closed(job, model, fragment)`` is called after each round's new model is installed.
    """

    def __init__(self, store: AveragingStore, *, max_numel: int, max_held_bytes: int,
                 clock: Callable[[], float] = time.monotonic,
                 on_closed: Callable[[str, str, int], None] | None = None) -> None:
        self.store = store
        self.max_numel = max_numel
        self.max_held_bytes = max_held_bytes
        self.clock = clock
        self.on_closed = on_closed
        self.fragments: dict[tuple[str, str, int], Fragment] = {}
        self.replicas: dict[str, dict[str, ReplicaRecord]] = {}
        self.held_bytes = 0

    # -- replicas ---------------------------------------------------------------------------

    def replica(self, job: str, name: str) -> ReplicaRecord:
        """The record of ``name`` in ``job`` (created on first sight), marked seen now."""
        record = self.replicas.setdefault(job, {}).setdefault(name, ReplicaRecord())
        record.last_seen = self.clock()
        return record

    def _active(self, job: str) -> frozenset[str]:
        return frozenset(n for n, r in self.replicas.get(job, {}).items() if r.active)

    # -- seed and fetch ---------------------------------------------------------------------

    def check_numel(self, numel: int) -> None:
        """Raises: HubCapacityError: ``numel`` float32 elements are over the hub's limit."""
        if numel > self.max_numel:
            raise HubCapacityError(
                f"a fragment of {numel} float32 elements is over this coordinator's limit of "
                f"{self.max_numel} (--max-tensor-bytes)")

    def seed(self, job: str, model: str, fragment: int, replica: str,
             params: np.ndarray) -> int:
        """Join ``replica``; store ``params`` as the global fragment unless one exists.

        Returns the global fragment's completed rounds.

        Raises:
            RoundMismatchError: the hub's fragment has another size.
        """
        key = (job, model, fragment)
        held = self._model(key)
        if held is None:
            self.store.install(self._store_key(key), GlobalModel(params.copy(), None, 0))
            self.fragments[key] = Fragment(params.shape[0])
            held = self._model(key)
        elif held.params.shape[0] != params.shape[0]:
            raise RoundMismatchError(
                f"fragment {fragment} of model {model!r} in job {job!r} has "
                f"{held.params.shape[0]} parameters on the coordinator, but replica "
                f"{replica!r} seeds {params.shape[0]}; every replica must fragment the same "
                "model the same way")
        record = self.replica(job, replica)
        # A join: a newcomer, one back after missing rounds, or one seeding a fragment it
        # seeded before (a restart, e.g. by the agent, even before its absence was noticed).
        if not record.active or (model, fragment) in record.seeded:
            record.joins += 1
            record.seeded.clear()
        record.seeded.add((model, fragment))
        record.active = True
        log.info("job %r: replica %r joined %r fragment %d at round %d", job, replica, model,
                 fragment, held.rounds)
        return held.rounds

    def holds(self, job: str, model: str, fragment: int, replica: str) -> bool:
        """Whether the fragment's open round holds ``replica``'s contribution."""
        frag = self.fragments.get((job, model, fragment))
        return frag is not None and frag.open is not None and replica in frag.open.contributions

    def global_model(self, job: str, model: str, fragment: int) -> GlobalModel | None:
        """The fragment's global model (loaded from the state directory if need be)."""
        return self._model((job, model, fragment))

    # -- contribute and close ---------------------------------------------------------------

    def contribute(self, job: str, model: str, fragment: int, replica: str, number: int,
                   policy: Policy, delta: np.ndarray) -> tuple[bool, int]:
        """Take ``replica``'s pseudo-gradient for round ``number``.

        Returns (accepted, completed rounds after this call): not accepted when the round
        already closed without it (the replica is alive, not missed).

        Raises:
            RoundMismatchError: no global fragment (seed first), a size or policy unlike the
                round's, or a round that has not begun.
            HubCapacityError: holding the contribution would pass the hub's memory bound.
        """
        key = (job, model, fragment)
        held = self._model(key)
        if held is None:
            raise RoundMismatchError(
                f"job {job!r} has no fragment {fragment} of model {model!r} to contribute to; "
                "seed it first (gradstar.StreamingDiLoCo does when it starts)")
        if delta.shape[0] != held.params.shape[0]:
            raise RoundMismatchError(
                f"replica {replica!r} sent {delta.shape[0]} values for fragment {fragment} of "
                f"{model!r}, which has {held.params.shape[0]}")
        record = self.replica(job, replica)
        if number < held.rounds:
            record.late += 1
            record.active = True  # it is alive; it joins the next round
            return False, held.rounds
        if number > held.rounds:
            raise RoundMismatchError(
                f"replica {replica!r} contributed to round {number} of fragment {fragment} of "
                f"{model!r}, but only {held.rounds} rounds completed; fetch the global model")
        frag = self.fragments.setdefault(key, Fragment(held.params.shape[0]))
        now = self.clock()
        if frag.open is None:
            frag.open = OpenRound(number, policy, now + policy.round_timeout,
                                  self._active(job) | {replica})
        elif frag.open.policy != policy:
            raise RoundMismatchError(
                f"replica {replica!r} contributed to round {number} of fragment {fragment} of "
                f"{model!r} with {policy}, but the round runs with {frag.open.policy}")
        if replica not in frag.open.contributions:
            if self.held_bytes + delta.nbytes > self.max_held_bytes:
                raise HubCapacityError(
                    f"the coordinator holds {self.held_bytes} bytes of open rounds and may hold "
                    f"{self.max_held_bytes}; replica {replica!r}'s contribution was refused")
            frag.open.contributions[replica] = delta
            self.held_bytes += delta.nbytes
            record.contributed += 1
        record.active = True
        self._maybe_close(key, frag, now)
        return True, self._model(key).rounds

    def leave(self, job: str, replica: str) -> list[tuple[str, str, int]]:
        """``replica`` left for good: no open round of ``job`` waits for it any longer (each
        closes now if every other expected replica contributed and there are enough); return
        the rounds that closed."""
        record = self.replica(job, replica)
        record.active = False
        record.seeded.clear()
        now, closed = self.clock(), []
        for key, frag in list(self.fragments.items()):
            rnd = frag.open
            if key[0] != job or rnd is None or replica not in rnd.expected:
                continue
            if replica not in rnd.contributions:
                rnd.expected = rnd.expected - {replica}
            if self._maybe_close(key, frag, now):
                closed.append(key)
        log.info("job %r: replica %r left its rounds", job, replica)
        return closed

    def close_due(self) -> list[tuple[str, str, int]]:
        """Close the rounds whose deadline passed (with enough contributions); return them."""
        now = self.clock()
        closed = []
        for key, frag in list(self.fragments.items()):
            if frag.open is not None and self._maybe_close(key, frag, now):
                closed.append(key)
        return closed

    def next_deadline(self) -> float | None:
        deadlines = [f.open.deadline for f in self.fragments.values() if f.open is not None]
        return min(deadlines) if deadlines else None

    def _maybe_close(self, key, frag: Fragment, now: float) -> bool:
        rnd = frag.open
        got = set(rnd.contributions)
        if len(got) < max(1, rnd.policy.min_replicas):
            return False
        if not rnd.expected <= got and now < rnd.deadline:
            return False
        self._close(key, frag, rnd, now)
        return True

    def _close(self, key, frag: Fragment, rnd: OpenRound, now: float) -> None:
        job, model, fragment = key
        names = sorted(rnd.contributions)
        # Summed in name order: the result is the same whichever replica arrived first.
        mean = rnd.contributions[names[0]].copy()
        for name in names[1:]:
            np.add(mean, rnd.contributions[name], out=mean)
        np.divide(mean, np.float32(len(names)), out=mean)
        p = rnd.policy
        spec = cpb.AveragingSpec(
            model=self._store_key(key)[1], outer_lr=p.outer_lr, outer_momentum=p.outer_momentum,
            rule=(cpb.AVERAGING_RULE_OUTER_NESTEROV if p.nesterov
                  else cpb.AVERAGING_RULE_OUTER_SGD))
        staged = self.store.open_round(job, spec, mean.shape[0])
        staged.replicas = tuple(names)
        staged.apply(0, mean)
        frag.open = None
        self.held_bytes -= sum(c.nbytes for c in rnd.contributions.values())
        missed = tuple(sorted(rnd.expected - set(names)))
        try:
            staged.commit()
        except OSError as error:
            # The round itself is sound: install it in memory so training goes on, and say
            # loudly that the state directory lags behind.
            log.error("job %r: could not persist round %d of %r fragment %d: %s", job,
                      rnd.number, model, fragment, error)
            self.store.install(staged.key, staged.result(), persist=False)
        for name in missed:
            record = self.replica(job, name)
            record.missed += 1
            record.active = False
        frag.history.append(ClosedRound(rnd.number, tuple(names), missed, now))
        if missed:
            log.warning("job %r: round %d of %r fragment %d closed with %d replicas; dropped %s",
                        job, rnd.number, model, fragment, len(names), ", ".join(missed))
        if self.on_closed is not None:
            self.on_closed(job, model, fragment)

    # -- views ------------------------------------------------------------------------------

    def job_fragments(self, job: str) -> list[tuple[str, int, Fragment, GlobalModel]]:
        out = []
        for (j, model, fragment), frag in sorted(self.fragments.items()):
            held = self._model((j, model, fragment)) if j == job else None
            if held is not None:
                out.append((model, fragment, frag, held))
        return out

    def drop_idle(self, retention: float) -> list[str]:
        """Forget the rounds of jobs none of whose replicas was heard from for ``retention``
        seconds, open rounds included (their fragments stay in the state directory, if any,
        and load again when a replica comes back; a replica still waiting sends its
        contribution again). Returns their names."""
        now = self.clock()
        dropped = []
        for job in self.jobs():
            records = self.replicas.get(job, {})
            if any(now - r.last_seen < retention for r in records.values()):
                continue
            for key in [k for k in self.fragments if k[0] == job]:
                rnd = self.fragments.pop(key).open
                if rnd is not None:
                    self.held_bytes -= sum(c.nbytes for c in rnd.contributions.values())
            self.replicas.pop(job, None)
            self.store.forget(job)
            dropped.append(job)
        return dropped

    def jobs(self) -> list[str]:
        return sorted({k[0] for k in self.fragments} | set(self.replicas))

    # -- the store --------------------------------------------------------------------------

    @staticmethod
    def _store_key(key: tuple[str, str, int]) -> tuple[str, str]:
        job, model, fragment = key
        # '#' cannot clash: this table has an averaging store of its own.
        return job, f"{model}#{fragment}"

    def _model(self, key: tuple[str, str, int]) -> GlobalModel | None:
        held = self.store.get(*self._store_key(key))
        if held is not None and key not in self.fragments:
            self.fragments[key] = Fragment(held.params.shape[0])  # loaded from --state-dir
            # A restarted coordinator: the replicas of the last round are expected in the
            # next, as they were (else its first contributions close it without the others).
            for name in held.replicas:
                record = self.replicas.setdefault(key[0], {}).setdefault(name, ReplicaRecord())
                if not record.active:
                    record.active, record.last_seen = True, self.clock()
        return held
