"""Elastic joins: a rank that takes the place of a lost member of its job's running generation
(:func:`replace`), or that joins it past its world size while the job may grow (:func:`grow`).
What :meth:`~.rendezvous.Rendezvous.offer` does for an ``elastic`` join; no I/O."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gradstar.errors import GradstarError, RendezvousError

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


def grow(state: Job, peer_address: str, host: str, hostname: str,
         fail: Callable[[Generation, GradstarError], None]) -> Member:
    """One more rank in the job's running generation (an elastic join past its world size,
    within ``max_world_size``): rank ``world_size``, which grows by one. The generation's
    collectives span a fixed set of ranks, so they are over, failed with a named error;
    what the ranks do without them (a sync-mode DDP's steps, on the hub's ledger, which
    counts the new rank from its first call) goes on, and the newcomer starts from the
    hub's state (it joins as a replacement does)."""
    gen = state.generation
    member = Member(job=state.name, requested_rank=gen.world_size, peer_address=peer_address,
                    host=host[:64], hostname=hostname[:255])
    member.rank, member.generation, member.replacement = gen.world_size, gen, True
    gen.members[member.rank] = member
    gen.world_size += 1
    state.world_size = gen.world_size
    member.touch()
    member.joined = asyncio.get_running_loop().create_future()
    member.joined.set_result(gen)
    log.info("job %r grew to %d ranks: rank %d joined generation %d", state.name,
             gen.world_size, member.rank, gen.number)
    fail(gen, RendezvousError(
        f"job {state.name!r} grew to {gen.world_size} ranks (an elastic join past its world "
        f"size), so generation {gen.number}'s collectives are over; its sync-mode steps "
        "go on"))
    return member
