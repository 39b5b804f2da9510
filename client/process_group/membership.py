"""Where a rank is in its job's step boundaries, and what it does at one: go on, move to the
job's next generation, or leave (the rank's half of ``gradstar.coordinator.rendezvous.resize``).

A wrapper that synchronises whole steps (a Synchronous DDP) calls :meth:`Membership.crossing`
before the first collective of each step. The count of steps begun is the rank's position.
While the job resizes the coordinator asks for it (``ResizePending``, answered at once from the
session's loop) and then names the boundary every member reaches (``ResizeAt``); between the
two the rank holds before its next step, so that it cannot pass the boundary unknowingly. At
the boundary :meth:`crossing` says ``"move"`` (or ``"leave"`` after :meth:`depart`), the
process group moves, and crosses again in its new generation (the step begins, or another
resize named the same boundary meanwhile and it moves once more): :meth:`gradstar.client.
process_group.ProcessGroup.step_boundary`.

The training thread and the session's loop both touch the state, under one lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from gradstar.errors import ConfigurationError, RendezvousError
from gradstar.proto.v1 import rendezvous_pb2 as rpb


@dataclass(frozen=True)
class Resized:
    """What a move to the job's next generation changed, as every rank of it sees it (read by
    a resize hook: re-shard the data with ``world_size`` and ``rank``)."""

    generation: int
    world_size: int
    rank: int
    previous_world_size: int
    previous_rank: int
    #: The ranks that joined at this boundary (the others' state was sent to them).
    newcomers: tuple[int, ...]
    #: Synchronising steps every rank had begun when it moved.
    boundary: int


class Membership:
    """This rank's position and the resize under way, across the generations it moves
    through (one per blocking process group)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        #: Synchronising steps begun.
        self.boundary = 0
        self._lock = threading.Lock()
        self._generation = 0
        self._reported: int | None = None
        self._decided: int | None = None
        self._heard = threading.Event()
        self._departing = False
        self._acknowledged = threading.Event()
        self._refused = ""
        self.departed = False

    def joined(self, joined: rpb.Joined) -> None:
        """A new generation (the first, or one this rank moved to): nothing is pending."""
        with self._lock:
            self._generation = joined.generation
            self._reported = self._decided = None
            self._heard.clear()
            if joined.resized:
                self.boundary = joined.boundary

    def heard(self, event: rpb.SessionEvent, session) -> None:
        """A resize notice on the session (its loop): answer a ``ResizePending`` with this
        rank's position, keep a ``ResizeAt``'s boundary."""
        with self._lock:
            if event.WhichOneof("kind") == "resize":
                pending = event.resize
                if pending.generation != self._generation:
                    return
                if pending.refused:
                    self._refused, self._departing = pending.refused, False
                    self._acknowledged.set()
                    return
                if self._departing:
                    self._acknowledged.set()
                if self._decided is None:
                    self._reported = self.boundary
                    session.send(rpb.SessionRequest(position=rpb.Position(
                        generation=self._generation, boundary=self.boundary)))
            elif event.resize_at.generation == self._generation:
                self._decided = event.resize_at.boundary
                self._heard.set()

    def _wait_decision(self) -> None:
        """Hold at the boundary this rank reported until the coordinator names the one every
        member reaches."""
        with self._lock:
            hold = self._reported == self.boundary and self._decided is None
        if hold:
            self.hold()

    def crossing(self) -> str:
        """Before the first collective of a step: ``"go"`` (the step is begun), ``"move"``
        (join the next generation first, then cross again) or ``"leave"`` (a departing
        rank's boundary: run no more steps).

        Raises:
            RendezvousError: the coordinator named no boundary within the timeout.
        """
        self._wait_decision()
        with self._lock:
            if self._decided is not None and self.boundary == self._decided:
                if self._departing:
                    self.departed = True
                    return "leave"
                return "move"
            self.boundary += 1
            return "go"

    def hold(self) -> None:
        """Wait until the coordinator names a boundary for a resize this rank has not heard
        of yet (its position goes out as the notice comes).

        Raises:
            RendezvousError: none within the timeout.
        """
        if not self._heard.wait(self.timeout):
            raise RendezvousError(
                f"the coordinator named no step boundary for the job's resize within "
                f"{self.timeout:g} s of this rank reaching step {self.boundary}")

    def depart(self, send) -> None:
        """Ask to leave the job for good at the next boundary; ``send(request)`` puts it on
        the session. Returns once the coordinator took it.

        Raises:
            ConfigurationError: the coordinator refused (the job would fall below its
                ``min_world_size``).
            RendezvousError: no answer within the timeout.
        """
        with self._lock:
            self._departing, self._refused = True, ""
            self._acknowledged.clear()
        send(rpb.SessionRequest(depart=True))
        if not self._acknowledged.wait(self.timeout):
            raise RendezvousError(f"the coordinator did not answer this rank's departure "
                                  f"within {self.timeout:g} s")
        if self._refused:
            raise ConfigurationError(self._refused)

    @property
    def departing(self) -> bool:
        return self._departing

    def at_departure(self) -> bool:
        """Whether a departing rank has reached the boundary it leaves at (holding for the
        coordinator's answer first, as :meth:`crossing` does)."""
        if not self._departing:
            return False
        self._wait_decision()
        with self._lock:
            if self._decided is not None and self.boundary == self._decided:
                self.departed = True
        return self.departed


__all__ = ["Membership", "Resized"]
