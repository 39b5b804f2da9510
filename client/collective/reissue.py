"""Collectives issued again, same seq, after the coordinator came back: the rank's half.

While a rank rides through a restart of its coordinator (:mod:`gradstar.client.reconnect`),
every collective that failed because the coordinator went away is issued again with the same
header (the rebuilt generation keeps its number and member ids), and so is every collective
some *other* rank had not seen complete: the coordinator may have sent one rank its result and
died before it sent the next one theirs. :class:`Reissue` keeps what that takes:

- **Its input until it completes.** An in-place collective (``all_reduce(x, out=x)``, as DDP
  reduces its buckets) overwrites its input chunk by chunk as the result arrives, so one
  interrupted half-way has neither its input nor its result: its input is copied when it is
  issued, and the copy is what it sends again. Cost: one copy of the input per in-place
  collective, and the memory of the copies held (below). Any other collective sends its input
  itself again (the caller leaves it alone until the call resolves, as in torch.distributed).
- **In-place collectives that completed, until no rank can still need them.** Their copy is
  kept until a collective issued *after* it completed has completed too: that one's completion
  proves every rank issued it, and a rank that issues collectives in phases (DDP's buckets of
  step n, then those of step n+1) issued it only after its own earlier ones completed. So a
  data-parallel rank holds at most about two steps' gradients (those in flight and those of
  the step before). A completed collective that is not in place is not kept (its input is the
  caller's again): should the coordinator die between sending its result to one rank and to
  another, the rejoin is refused (:class:`~gradstar.errors.RejoinRefusedError`), as it is for
  a rank that ran ahead further and dropped what another needs: never a wrong result.

Sequence numbers are the group's (:class:`Seqs`: handed out in call order, as before); the
rejoin claim (:meth:`Reissue.claim`) says which are pending and which retained.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from gradstar import ops
from gradstar.errors import GradstarError
from gradstar.proto.v1 import rendezvous_pb2 as rpb

from ..reconnect import Ride

log = logging.getLogger(__name__)

#: Runs a collective once: ``attempt(send, out)`` sends from ``send`` into ``out``.
Attempt = Callable[[np.ndarray | None, np.ndarray], Awaitable[np.ndarray]]


class Seqs:
    """A group's collective sequence numbers, 1, 2, ... in call order (``next(seqs)``), which
    can say which comes next (:attr:`next`)."""

    def __init__(self) -> None:
        self.next = 1

    def __iter__(self) -> Seqs:
        return self

    def __next__(self) -> int:
        seq, self.next = self.next, self.next + 1
        return seq


@dataclass(eq=False)
class Held:
    """One collective a rank may issue again: its call, the copy of its input, and how to
    run it once (``attempt``); when it was issued and completed, in completions so far."""

    call: ops.CollectiveCall
    send: np.ndarray | None
    out_shape: tuple[int, ...]
    out_dtype: np.dtype
    attempt: Attempt
    issued_at: int
    #: ``send`` is a copy of the input, this rank's own (an in-place collective's).
    owned: bool = False
    completed_at: int = -1

    @property
    def seq(self) -> int:
        return self.call.header.seq


class Reissue:
    """The collectives of one group that may have to be issued again (see the module)."""

    def __init__(self, seqs: Seqs) -> None:
        self.seqs = seqs
        self.pending: dict[int, Held] = {}
        self.retained: dict[int, Held] = {}
        self._completions = 0
        # Collectives of the blocking API's direct lane are held from their caller's thread.
        self._lock = threading.Lock()
        self._replays: set[asyncio.Task] = set()

    def hold(self, call: ops.CollectiveCall, send: np.ndarray | None, out: np.ndarray,
             attempt: Attempt) -> Held:
        """Keep collective ``call`` until no rank can need it again: its input ``send``
        itself (the caller leaves it alone until the call resolves), or a copy of it when the
        result ``out`` overwrites it."""
        owned = send is not None and np.may_share_memory(send, out)
        kept = np.array(send, copy=True) if owned else send
        with self._lock:
            held = Held(call, kept, out.shape, out.dtype, attempt, self._completions, owned)
            self.pending[held.seq] = held
        return held

    def completed(self, held: Held) -> None:
        """``held`` completed on this rank: retain it if its input is a copy of its own (the
        caller's buffer is the caller's again), and drop what it proves no rank needs."""
        with self._lock:
            self.pending.pop(held.seq, None)
            held.completed_at = self._completions
            self._completions += 1
            self.retained = {s: h for s, h in self.retained.items()
                             if h.completed_at >= held.issued_at}
            if held.owned or held.send is None:
                self.retained[held.seq] = held

    def dropped(self, held: Held) -> None:
        """``held`` failed for good (or was cancelled): nothing to issue again."""
        with self._lock:
            self.pending.pop(held.seq, None)

    def claim(self, joined: rpb.Joined) -> rpb.Rejoin:
        """What this rank holds of generation ``joined`` (JoinRequest.rejoin)."""
        with self._lock:
            return rpb.Rejoin(generation=joined.generation, member_id=joined.member_id,
                              next_seq=self.seqs.next, pending=sorted(self.pending),
                              retained=sorted(self.retained))

    @property
    def held_bytes(self) -> int:
        """Bytes of input copies held now (what riding through restarts costs in memory)."""
        with self._lock:
            return sum(h.send.nbytes for h in (*self.pending.values(), *self.retained.values())
                       if h.owned)

    async def run(self, held: Held, out: np.ndarray, ride: Ride) -> np.ndarray:
        """Run ``held`` into ``out`` until it completes, issuing it again (same seq) after each
        failure that ``ride`` says the coordinator's restart caused (:meth:`Ride.until_back`).

        Raises:
            GradstarError: the collective's own failure, or the session's.
        """
        try:
            while True:
                began = ride.epoch
                try:
                    result = await held.attempt(held.send, out)
                except GradstarError as error:
                    if not await ride.until_back(began, error):
                        raise
                    continue
                except asyncio.CancelledError:
                    # Not this task's cancellation but its call's: a rejoin closed the data
                    # plane it ran on (the coordinator it reached had stopped answering).
                    if asyncio.current_task().cancelling() or ride.epoch == began:
                        raise
                    continue
                self.completed(held)
                return result
        except BaseException:
            self.dropped(held)
            raise

    def replay(self, seqs, ride: Ride) -> None:
        """Issue again the retained collectives among ``seqs`` (the coordinator's replay set:
        some rank had not seen them complete), each on a task of its own, into a scratch
        buffer: this rank already has their result. Pending ones issue themselves again."""
        with self._lock:
            again = [self.retained[s] for s in seqs if s in self.retained]
        for held in again:
            task = asyncio.ensure_future(self._replay(held, ride))
            self._replays.add(task)
            task.add_done_callback(self._replays.discard)

    async def _replay(self, held: Held, ride: Ride) -> None:
        scratch = np.empty(held.out_shape, held.out_dtype)
        while True:
            began = ride.epoch
            try:
                await held.attempt(held.send, scratch)
                return
            except GradstarError as error:
                try:
                    if await ride.until_back(began):
                        continue
                except GradstarError:
                    pass
                # The ranks that wait for it fail it themselves, with the hub's verdict.
                log.warning("collective seq %d, issued again for the other ranks, failed: %s",
                            held.seq, error)
                return


__all__ = ["Attempt", "Held", "Reissue", "Seqs"]
