"""Elastic joins: a rank that takes the place of a lost member of its job's running generation
(:func:`replace`), or that joins it past its world size while the job may grow
(:func:`past_size`).
What :meth:`~.rendezvous.Rendezvous.offer` does for an ``elastic`` join; no I/O."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gradstar.errors import GradstarError, RendezvousError

from . import resize
from .jobs import Generation, Job, Member

log = logging.getLogger(__name__)


def replace(state: Job, rank: int | None, peer_address: str, host: str,
            hostname: str) -> Member | None:
    """A member in the place of the lost ``rank`` (None: the lowest lost one) of the job's
    running generation, while others of it are live; None when there is no such place.
    The generation stays failed for collectives; what the newcomer does without them (a
    sync-mode DDP's steps) goes on."""
    gen = state.generation
    if gen is None or not gen.live_members or state.world_size != gen.world_size:
        return None
    lost = sorted(r for r, m in gen.members.items() if m.left and not m.finished)
    if rank is not None:
        lost = [r for r in lost if r == rank]
    if not lost:
        return None
    member = Member(job=state.name, requested_rank=lost[0], peer_address=peer_address,
                    host=host[:64], hostname=hostname[:255])
    member.rank, member.generation, member.replacement = lost[0], gen, True
    gen.members[member.rank] = member
    member.touch()
    member.joined = asyncio.get_running_loop().create_future()
    member.joined.set_result(gen)
    log.info("job %r: rank %d joined generation %d in the place of its lost member",
             state.name, member.rank, gen.number)
    return member


def past_size(state: Job, peer_address: str, host: str, hostname: str,
              fail: Callable[[Generation, GradstarError], None]) -> Member | None:
    """An elastic join past the running generation's world size, while the job may grow
    (``max_world_size``); None when it has no room. How the job takes a new rank depends on
    what its members said they do (``SessionRequest.boundaries``): when every one moves at
    step boundaries (a Synchronous DDP, LocalSGD) the joiner waits for the next one
    (:mod:`.resize`); when one does not (a sync-mode DDP said so) it joins at once
    (:func:`grow`); while some have not said yet (their wrappers are being built) it is
    *parked* until they have (:func:`declared`), so that a joiner that comes early does not
    end the collectives of a job that would have moved."""
    gen = state.generation
    pending = resize.current(state, gen)
    waiting = (len(pending.joiners) if pending is not None else 0) + len(state.parked)
    if gen.world_size + waiting >= state.max_world_size:
        return None
    member = Member(job=state.name, requested_rank=None, peer_address=peer_address,
                    host=host[:64], hostname=hostname[:255])
    member.joined = asyncio.get_running_loop().create_future()
    if not _route(state, member, fail):
        state.parked.append(member)
        log.info("job %r: a joiner waits until every rank said how the job takes it",
                 state.name)
    return member


def _route(state: Job, member: Member,
           fail: Callable[[Generation, GradstarError], None]) -> bool:
    """Send a joiner past the world size the way its job takes it: to the next step boundary,
    or into the running generation at once; False while some member has not said which."""
    if resize.takes_part(state):
        resize.add_joiner(state, member)
    elif undecided(state):
        return False
    else:
        grow(state, member, fail)
    return True


def undecided(state: Job) -> bool:
    """Whether some live member of the running generation has not said yet whether it moves at
    step boundaries, and none said it does not."""
    said = {m.boundaries for m in state.generation.live_members}
    return None in said and False not in said


def declared(state: Job, fail: Callable[[Generation, GradstarError], None]) -> None:
    """A member said whether it moves at step boundaries: the parked joiners go their way once
    every member has (or one said it does not)."""
    gen = state.generation
    while (state.parked and gen is not None and gen.healthy
           and _route(state, state.parked[0], fail)):
        state.parked.pop(0)


def unsaid(job: str, timeout: float) -> str:
    """Why a parked joiner's join timed out."""
    return (f"Timed out: job {job!r} may grow, but within {timeout:g} s not every rank said how "
            "it takes a new rank: a Synchronous DDP or LocalSGD takes it at a step boundary, "
            "a sync-mode DDP on the hub's step ledger; ranks that only run collectives (or "
            "FSDP, a Pipeline) cannot grow")


def grow(state: Job, member: Member, fail: Callable[[Generation, GradstarError], None]
         ) -> Member:
    """``member`` as one more rank of the job's running generation (an elastic join past its
    world size, within ``max_world_size``): rank ``world_size``, which grows by one. The
    generation's collectives span a fixed set of ranks, so they are over, failed with a named
    error; what the ranks do without them (a sync-mode DDP's steps, on the hub's ledger, which
    counts the new rank from its first call) goes on, and the newcomer starts from the hub's
    state (it joins as a replacement does)."""
    gen = state.generation
    member.requested_rank = gen.world_size
    member.rank, member.generation, member.replacement = gen.world_size, gen, True
    gen.members[member.rank] = member
    gen.world_size += 1
    state.world_size = gen.world_size
    member.touch()
    member.joined.set_result(gen)
    log.info("job %r grew to %d ranks: rank %d joined generation %d", state.name,
             gen.world_size, member.rank, gen.number)
    fail(gen, RendezvousError(
        f"job {state.name!r} grew to {gen.world_size} ranks (an elastic join past its world "
        f"size), so generation {gen.number}'s collectives are over; its sync-mode steps "
        "go on"))
    return member
