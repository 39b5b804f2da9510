"""Resizing a running Synchronous job at a step boundary: ranks join past its world size, or
leave it for good, without ending it.

A generation's collectives span a fixed set of ranks, so a job that changes size moves to a
new generation. Its members must all move at the same point of their step sequence, or one
would wait in a collective of the old generation for another already in the new one. The
coordinator finds that point with one exchange, only while a resize is pending:

1. Something asks for a resize: an elastic joiner past the world size (within
   ``max_world_size``), or a member's ``depart``. Every live member hears
   :class:`Pending` (``ResizePending``) and answers its :class:`Position`: how many
   synchronising steps it has begun, ``b``. It holds before its next one until it hears back.
2. Once every live member answered, the boundary is ``B = max(b)``, and every member hears it
   (``ResizeAt``). In a Synchronous job the answers differ by at most one (a rank cannot begin
   step ``k + 1`` before every rank began step ``k``), so every member reaches ``B``: one that
   answered ``B - 1`` runs one more step first.
3. At ``B`` a member says ``advance`` and joins the next generation (``JoinRequest.
   moving_from``, checked against its place in the old one); a departing member leaves. When
   every member still expected has arrived the next generation forms: the movers keep their
   order (ranks 0..k-1), the joiners waiting then follow, and its ``Joined`` names them as
   newcomers, so that rank 0 sends them its state. The old generation ends quietly: nothing in
   it failed.

Every member must take part (``SessionRequest.boundaries``, which a Synchronous DDP sends);
otherwise a join past the world size takes the other road (:func:`.elastic.grow`). A member lost
during a resize fails the generation as always, and the resize with it: every joiner and mover
waiting gets that error. A member that finishes (closes its group) instead of moving counts as
departing. No I/O here: the rendezvous drives it and tests can drive it directly.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from gradstar.errors import GradstarError, RankLostError, RendezvousError

from .jobs import Generation, Job, Member

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pending:
    """The session notice ``ResizePending``: answer with a position."""

    generation: int
    joining: int
    departing: tuple[int, ...]
    refused: str = ""


@dataclass(frozen=True)
class Decided:
    """The session notice ``ResizeAt``: move at this boundary."""

    generation: int
    boundary: int


@dataclass(eq=False)
class Resize:
    """One resize of one generation, from the first request to the next generation."""

    generation: Generation
    joiners: list[Member] = field(default_factory=list)
    departing: set[int] = field(default_factory=set)
    positions: dict[int, int] = field(default_factory=dict)
    boundary: int | None = None
    #: Old rank -> its member record in the next generation, once it joined there.
    arrived: dict[int, Member] = field(default_factory=dict)
    #: Old ranks that said ``advance``: their session's end is a move, not a finish.
    moved: set[int] = field(default_factory=set)

    def expected(self) -> list[int]:
        """The old ranks the next generation waits for: those still live or moving, less the
        departing ones."""
        return sorted(r for r, m in self.generation.members.items()
                      if (not m.left or r in self.moved) and r not in self.departing)


def current(state: Job, gen: Generation) -> Resize | None:
    """``state``'s resize of ``gen``, or None."""
    resize = state.resize
    return resize if isinstance(resize, Resize) and resize.generation is gen else None


def takes_part(state: Job) -> bool:
    """Whether ``state``'s running generation resizes at step boundaries: healthy, and every
    live member moves at them."""
    gen = state.generation
    return (gen is not None and gen.healthy and bool(gen.live_members)
            and all(m.boundaries for m in gen.live_members))


def _start(state: Job) -> Resize:
    resize = current(state, state.generation)
    if resize is None:
        resize = state.resize = Resize(state.generation)
        log.info("job %r: resizing generation %d at the next step boundary", state.name,
                 resize.generation.number)
    return resize


def _announce(resize: Resize) -> None:
    notice = Pending(resize.generation.number, len(resize.joiners), tuple(sorted(
        resize.departing)))
    for m in resize.generation.live_members:
        if m.rank not in resize.positions:
            m.notices.put_nowait(notice)


def add_joiner(state: Job, joiner: Member) -> None:
    """Queue an elastic joiner past the world size: it joins the next generation."""
    resize = _start(state)
    if joiner.joined is None:
        joiner.joined = asyncio.get_running_loop().create_future()
    resize.joiners.append(joiner)
    if resize.boundary is None:
        _announce(resize)


def depart(state: Job, member: Member) -> None:
    """``member`` leaves the job for good at the next boundary; refused (with a notice saying
    why) when that would leave fewer than ``min_world_size`` ranks."""
    gen = member.generation
    if gen is None or gen is not state.generation or member.left:
        return
    resize = current(state, gen)
    departing = len(resize.departing) if resize is not None else 0
    if state.min_world_size and len(gen.live_members) - departing - 1 < state.min_world_size:
        member.notices.put_nowait(Pending(gen.number, 0, (), refused=(
            f"rank {member.rank} of job {state.name!r} may not leave: the job would have "
            f"{len(gen.live_members) - departing - 1} ranks, fewer than its min_world_size "
            f"{state.min_world_size}")))
        return
    resize = _start(state)
    if resize.boundary is not None:
        # The boundary is named; the member stops there and its rank is not expected.
        resize.departing.add(member.rank)
        member.notices.put_nowait(Pending(gen.number, len(resize.joiners),
                                          tuple(sorted(resize.departing))))
        return
    resize.departing.add(member.rank)
    resize.positions.pop(member.rank, None)  # it answers again, knowing it departs
    _announce(resize)


def report(state: Job, member: Member, generation: int, boundary: int) -> None:
    """``member``'s position; the boundary is decided once every live member answered."""
    resize = current(state, member.generation)
    if resize is None or generation != resize.generation.number or resize.boundary is not None:
        return
    resize.positions[member.rank] = boundary
    _decide(resize, state)


def _decide(resize: Resize, state: Job) -> None:
    live = {m.rank for m in resize.generation.live_members}
    if resize.boundary is not None or not live <= resize.positions.keys():
        return
    resize.boundary = max(resize.positions[r] for r in live)
    log.info("job %r: generation %d moves at step boundary %d (%d joining, departing: %s)",
             state.name, resize.generation.number, resize.boundary, len(resize.joiners),
             sorted(resize.departing) or "none")
    notice = Decided(resize.generation.number, resize.boundary)
    for m in resize.generation.live_members:
        m.notices.put_nowait(notice)


def advance(state: Job, member: Member) -> None:
    """``member`` is at the boundary and about to join the next generation."""
    resize = current(state, member.generation)
    if resize is not None and resize.boundary is not None:
        resize.moved.add(member.rank)


def moving(state: Job, member: Member) -> bool:
    """Whether ``member``'s session ends because it moves (its leave is quiet)."""
    resize = current(state, member.generation)
    return resize is not None and member.rank in resize.moved


def leaving(state: Job, member: Member) -> bool:
    """Whether ``member``'s session ending is its goodbye, read or not: it moves, or departs
    at a boundary already named (a close that gave up on a loaded machine before the hub read
    its goodbye is no lost rank)."""
    resize = current(state, member.generation)
    return moving(state, member) or (resize is not None and resize.boundary is not None
                                     and member.rank in resize.departing)


def end_overdue(state: Job, now: float, timeout: float,
                fail: Callable[[Generation, GradstarError], None]) -> None:
    """End ``state``'s resize, failing its generation, when one of its movers left its old
    session more than ``timeout`` seconds ago (its last heartbeat) and has not arrived in the
    next generation: it was lost on its way."""
    resize = state.resize
    if not isinstance(resize, Resize) or resize.boundary is None:
        return
    members = resize.generation.members
    late = next((members[r] for r in sorted(resize.moved - resize.arrived.keys())
                 if members[r].left and now - members[r].last_seen > timeout), None)
    if late is not None:
        fail(resize.generation, RankLostError(
            f"rank {late.rank} of job {state.name!r} was lost (it left generation "
            f"{resize.generation.number} to move to the next one and did not arrive within "
            f"{timeout:g} s); the resize is over", rank=late.rank,
            generation=resize.generation.number))


def arrive(state: Job | None, moving_from, member: Member,
           form: Callable[[Job, dict[int, Member]], Generation]) -> None:
    """``member`` (a new record) joins the next generation as the mover ``moving_from`` names.

    Raises:
        RendezvousError: no resize of that generation has named its boundary, or the mover is
            not the member it says (rank and member id).
    """
    gen = state.generation if state is not None else None
    resize = current(state, gen) if gen is not None else None
    old = gen.members.get(moving_from.rank) if gen is not None else None
    if (resize is None or resize.boundary is None or gen.number != moving_from.generation
            or old is None or not hmac.compare_digest(
                old.member_id.encode(), moving_from.member_id.encode("utf-8", "replace"))
            or moving_from.rank in resize.departing or moving_from.rank in resize.arrived):
        where = gen.number if gen is not None else "none"
        raise RendezvousError(
            f"no resize of job {member.job!r} generation {moving_from.generation} waits for "
            f"rank {moving_from.rank} (the job is at generation {where}): a member moves to "
            "the next generation only at the boundary the coordinator named, once, with the "
            "member id its join gave it")
    resize.moved.add(moving_from.rank)
    member.joined = asyncio.get_running_loop().create_future()
    resize.arrived[moving_from.rank] = member
    settle(state, form)


def settle(state: Job, form: Callable[[Job, dict[int, Member]], Generation]) -> None:
    """Re-read a resize after a change (an arrival, a member gone, a joiner withdrawn): decide
    its boundary once every live member answered; form the next generation once every expected
    member arrived; end it with a named error when nobody is left to move."""
    resize = state.resize
    if not isinstance(resize, Resize):
        return
    if resize.boundary is None:
        if not resize.generation.live_members:
            cancel(state, RendezvousError(
                f"every rank of job {state.name!r} generation {resize.generation.number} "
                "finished before the job could resize; no rank is left to join"))
            return
        _decide(resize, state)
        return
    expected = resize.expected()
    if not set(expected) <= resize.arrived.keys():
        return
    if not expected:
        cancel(state, RendezvousError(
            f"every rank of job {state.name!r} generation {resize.generation.number} left "
            "before the job could resize; no rank is left to join"))
        return
    members = {}
    for new_rank, old_rank in enumerate(expected):
        members[new_rank] = resize.arrived[old_rank]
    joiners = [j for j in resize.joiners if not j.joined.done()]
    for j in joiners:
        j.newcomer = True
        members[len(members)] = j
    for m in members.values():
        m.boundaries, m.boundary = True, resize.boundary
    state.resize = None
    state.resizes += 1
    gen = form(state, members)
    log.info("job %r resized at step boundary %d: generation %d has %d ranks (%d new)",
             state.name, resize.boundary, gen.number, gen.world_size, len(joiners))


def withdraw(state: Job, joiner: Member) -> None:
    """A waiting joiner gave up (its join timed out, its process died). A mover that does
    ends the resize: the next generation can no longer form as its members were told."""
    if joiner in state.parked:
        state.parked.remove(joiner)
    resize = state.resize
    if not isinstance(resize, Resize):
        return
    if joiner in resize.joiners:
        resize.joiners.remove(joiner)
    gone = [r for r, m in resize.arrived.items() if m is joiner]
    if gone:
        cancel(state, RendezvousError(
            f"rank {gone[0]} of job {state.name!r} generation {resize.generation.number} "
            "gave up its move to the next generation (its join ended before every rank "
            "arrived); the resize is over"))


def cancel(state: Job, error: GradstarError) -> None:
    """End the resize: every joiner and mover still waiting gets ``error``."""
    resize = state.resize
    if not isinstance(resize, Resize):
        return
    state.resize = None
    for waiting in (*resize.joiners, *resize.arrived.values()):
        if waiting.joined is not None and not waiting.joined.done():
            waiting.joined.set_exception(error)


__all__ = ["Decided", "Pending", "Resize", "add_joiner", "advance", "arrive", "cancel",
           "current", "depart", "end_overdue", "leaving", "moving", "report", "settle",
           "takes_part", "withdraw"]
