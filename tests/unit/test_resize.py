"""A running job resized at a step boundary (``coordinator/rendezvous/resize.py``), driven
directly as the session servicer drives it: positions, the boundary, movers, newcomers,
departures, and what ends a resize. No sockets; every await is bounded."""

from __future__ import annotations

import asyncio

import pytest

from gradstar.coordinator.rendezvous import Rendezvous, elastic, resize
from gradstar.errors import (
    JoinTimeoutError,
    RankLostError,
    RendezvousError,
    WorldSizeMismatchError,
)
from gradstar.proto.v1 import rendezvous_pb2 as rpb

BOUND = 2.0


async def running(rdv: Rendezvous, world: int = 3, **limits) -> list:
    """A job 'r' of ``world`` ranks whose members move at step boundaries."""
    members = await asyncio.wait_for(asyncio.gather(*(
        rdv.join("r", world, rank, f"10.0.0.{rank}:1", timeout=BOUND, max_world_size=4,
                 **limits) for rank in range(world))), BOUND)
    for m in members:
        m.boundaries = True
    return members


def notices(member) -> list:
    out = []
    while not member.notices.empty():
        out.append(member.notices.get_nowait())
    return out


def moving_from(member) -> rpb.MovingFrom:
    return rpb.MovingFrom(generation=member.generation.number, rank=member.rank,
                          member_id=member.member_id)


async def move(rdv: Rendezvous, member):
    """``member`` says advance, leaves its session, and joins the next generation."""
    state = rdv.jobs[member.job]
    resize.advance(state, member)
    rdv.leave(member)
    return asyncio.ensure_future(rdv.join("r", 3, None, "10.0.1.1:1", timeout=BOUND,
                                          moving_from=moving_from(member)))


@pytest.fixture
def rdv() -> Rendezvous:
    return Rendezvous(heartbeat_timeout=10.0)


async def test_the_boundary_is_the_furthest_position_and_the_job_grows_there(rdv):
    members = await running(rdv)
    joiner = asyncio.ensure_future(rdv.join("r", 3, None, "10.0.0.9:1", timeout=BOUND,
                                            elastic=True))
    await asyncio.sleep(0)
    state = rdv.jobs["r"]
    for m in members:  # every member is asked for its position
        assert [type(n) for n in notices(m)] == [resize.Pending]
    gen = members[0].generation
    for m, position in zip(members, (7, 8, 7), strict=True):
        resize.report(state, m, gen.number, position)
    assert [n.boundary for m in members for n in notices(m)] == [8, 8, 8]
    movers = [await move(rdv, m) for m in members]
    grown = await asyncio.wait_for(asyncio.gather(joiner, *movers), BOUND)
    new = grown[0].generation
    assert new is not gen and new.resized and new.world_size == 4
    assert [m.rank for m in grown[1:]] == [0, 1, 2] and grown[0].rank == 3
    assert [grown[0].newcomer, *(m.newcomer for m in grown[1:])] == [True, False, False, False]
    assert {m.boundary for m in grown} == {8} and all(m.boundaries for m in grown)
    assert gen.healthy and state.resizes == 1 and state.world_size == 4


async def test_a_departing_rank_is_dropped_and_the_ranks_after_it_move_up(rdv):
    members = await running(rdv)
    state, gen = rdv.jobs["r"], members[0].generation
    resize.depart(state, members[1])
    for m in members:
        resize.report(state, m, gen.number, 5)
    movers = [await move(rdv, m) for m in (members[0], members[2])]
    rdv.leave(members[1])  # the departing rank stops at the boundary
    moved = await asyncio.wait_for(asyncio.gather(*movers), BOUND)
    assert [m.rank for m in moved] == [0, 1] and moved[0].generation.world_size == 2
    assert not any(m.newcomer for m in moved)


async def test_a_departing_rank_whose_session_ends_before_its_goodbye_still_departs(rdv):
    # As a mover's (below): on a loaded machine the leaver's close may give up before the hub
    # read its goodbye. Once the boundary is named, its session ending is its departure, not
    # a lost rank that ends the others' move (benchmarks/elastic.py hit it at load 17).
    members = await running(rdv)
    state, gen = rdv.jobs["r"], members[0].generation
    resize.depart(state, members[1])
    for m in members:
        resize.report(state, m, gen.number, 5)
    rdv.lost(members[1], "its session with the coordinator closed")
    assert gen.failure is None
    movers = [await move(rdv, m) for m in (members[0], members[2])]
    moved = await asyncio.wait_for(asyncio.gather(*movers), BOUND)
    assert [m.rank for m in moved] == [0, 1] and moved[0].generation.world_size == 2


async def test_a_departing_rank_lost_before_the_boundary_is_named_is_lost(rdv):
    members = await running(rdv)
    state, gen = rdv.jobs["r"], members[0].generation
    resize.depart(state, members[1])
    rdv.lost(members[1], "its session with the coordinator closed")
    assert isinstance(gen.failure, RankLostError) and "rank 1" in str(gen.failure)


async def test_a_departure_below_the_minimum_is_refused_by_name(rdv):
    members = await running(rdv, world=2, min_world_size=2)
    resize.depart(rdv.jobs["r"], members[0])
    refused = notices(members[0])
    assert len(refused) == 1 and "fewer than its min_world_size 2" in refused[0].refused
    assert rdv.jobs["r"].resize is None and not notices(members[1])


async def test_a_rank_lost_during_a_resize_fails_the_joiner_by_name(rdv):
    members = await running(rdv)
    joiner = asyncio.ensure_future(rdv.join("r", 3, None, "10.0.0.9:1", timeout=BOUND,
                                            elastic=True))
    await asyncio.sleep(0)
    rdv.lost(members[2], "killed")
    with pytest.raises(RankLostError, match="rank 2 of job 'r' was lost"):
        await asyncio.wait_for(joiner, BOUND)
    assert rdv.jobs["r"].resize is None


async def grown_to_boundary(rdv: Rendezvous):
    """A running job of 3 with a joiner waiting and the boundary named (5)."""
    members = await running(rdv)
    joiner = asyncio.ensure_future(rdv.join("r", 3, None, "10.0.0.9:1", timeout=BOUND,
                                            elastic=True))
    await asyncio.sleep(0)
    state, gen = rdv.jobs["r"], members[0].generation
    for m in members:
        resize.report(state, m, gen.number, 5)
    return members, joiner, state, gen


async def test_a_mover_whose_session_ends_before_its_goodbye_still_moves(rdv):
    # On a loaded machine a mover's close may give up before the hub read its goodbye: its
    # session then ends without one. It said advance first, so it is moving, not lost.
    members, joiner, state, gen = await grown_to_boundary(rdv)
    resize.advance(state, members[1])
    rdv.lost(members[1], "its session with the coordinator closed")
    assert gen.failure is None and state.resize is not None
    movers = [await move(rdv, m) for m in (members[0], members[2])]
    movers.append(asyncio.ensure_future(rdv.join("r", 3, None, "10.0.1.1:1", timeout=BOUND,
                                                 moving_from=moving_from(members[1]))))
    grown = await asyncio.wait_for(asyncio.gather(joiner, *movers), BOUND)
    assert grown[0].generation.world_size == 4 and gen.failure is None
    assert sorted(m.rank for m in grown) == [0, 1, 2, 3]


async def test_a_mover_that_never_arrives_ends_the_resize_after_the_heartbeat_timeout(rdv):
    members, joiner, state, gen = await grown_to_boundary(rdv)
    resize.advance(state, members[1])
    rdv.lost(members[1], "its session with the coordinator closed")
    movers = [await move(rdv, m) for m in (members[0], members[2])]
    await asyncio.sleep(0)
    rdv.expire(members[1].last_seen + 5.0)  # within the timeout: still on its way
    assert gen.failure is None
    rdv.expire(members[1].last_seen + 10.5)
    for waiting in (joiner, *movers):
        with pytest.raises(RankLostError, match=r"rank 1 .* did not arrive within 10 s"):
            await asyncio.wait_for(waiting, BOUND)
    assert state.resize is None


async def test_a_mover_that_is_not_the_member_it_says_is_refused(rdv):
    members = await running(rdv)
    state, gen = rdv.jobs["r"], members[0].generation
    resize.depart(state, members[2])
    with pytest.raises(RendezvousError, match="no resize of job 'r' generation 1 waits"):
        await rdv.join("r", 3, None, "x:1", timeout=BOUND, moving_from=moving_from(members[0]))
    for m in members:
        resize.report(state, m, gen.number, 1)
    forged = rpb.MovingFrom(generation=gen.number, rank=0, member_id="not-its-id")
    with pytest.raises(RendezvousError, match="with the member id its join gave it"):
        await rdv.join("r", 3, None, "x:1", timeout=BOUND, moving_from=forged)
    departing = moving_from(members[2])  # a departing rank has no place in the next one
    with pytest.raises(RendezvousError, match="waits for rank 2"):
        await rdv.join("r", 3, None, "x:1", timeout=BOUND, moving_from=departing)
    assert state.resize is not None  # nothing the refused calls did changed the resize


async def test_a_joiner_that_gives_up_is_not_in_the_next_generation(rdv):
    members = await running(rdv)
    joiner = asyncio.ensure_future(rdv.join("r", 3, None, "10.0.0.9:1", timeout=0.05,
                                            elastic=True))
    with pytest.raises(Exception, match="Timed out"):
        await asyncio.wait_for(joiner, BOUND)
    state, gen = rdv.jobs["r"], members[0].generation
    for m in members:
        resize.report(state, m, gen.number, 3)
    moved = await asyncio.wait_for(asyncio.gather(*[await move(rdv, m) for m in members]),
                                   BOUND)
    assert moved[0].generation.world_size == 3 and not any(m.newcomer for m in moved)


async def test_a_job_whose_members_do_not_move_at_boundaries_grows_at_once(rdv):
    members = await running(rdv)
    members[1].boundaries = False  # a sync-mode DDP: its steps go on over the hub's ledger
    grown = await asyncio.wait_for(rdv.join("r", 3, None, "10.0.0.9:1", timeout=BOUND,
                                            elastic=True), BOUND)
    assert grown.generation is members[0].generation and grown.rank == 3
    assert rdv.jobs["r"].resize is None


async def test_a_joiner_that_comes_before_every_rank_said_how_waits_for_them(rdv):
    # A joiner that comes while the ranks still build their wrappers must not end the
    # collectives of a job that would have moved at a boundary: it waits until all have said.
    members = await running(rdv)
    for m in members:
        m.boundaries = None
    members[0].boundaries = True
    state = rdv.jobs["r"]
    joiner = asyncio.ensure_future(rdv.join("r", 3, None, "10.0.0.9:1", timeout=BOUND,
                                            elastic=True))
    await asyncio.sleep(0)
    assert state.parked and state.resize is None and members[0].generation.healthy
    for m in members[1:]:
        m.boundaries = True
        elastic.declared(state, rdv.fail)
    assert not state.parked and state.at_boundary == (1, 0)  # it waits for the boundary
    gen = members[0].generation
    for m in members:
        resize.report(state, m, gen.number, 2)
    grown = await asyncio.wait_for(asyncio.gather(joiner, *[await move(rdv, m)
                                                           for m in members]), BOUND)
    assert grown[0].newcomer and grown[0].generation.world_size == 4 and gen.healthy


async def test_a_parked_joiner_grows_the_job_once_a_rank_says_it_does_not_move(rdv):
    members = await running(rdv)
    for m in members:
        m.boundaries = None
    state = rdv.jobs["r"]
    joiner = asyncio.ensure_future(rdv.join("r", 3, None, "10.0.0.9:1", timeout=BOUND,
                                            elastic=True))
    await asyncio.sleep(0)
    members[2].boundaries = False  # a sync-mode DDP
    elastic.declared(state, rdv.fail)
    grown = await asyncio.wait_for(joiner, BOUND)
    assert grown.generation is members[0].generation and grown.rank == 3


async def test_a_parked_joiner_times_out_naming_what_the_ranks_did_not_say(rdv):
    members = await running(rdv)
    for m in members:
        m.boundaries = None
    with pytest.raises(JoinTimeoutError, match="not every rank said how it takes a new rank"):
        await rdv.join("r", 3, None, "10.0.0.9:1", timeout=0.05, elastic=True)
    assert not rdv.jobs["r"].parked and members[0].generation.healthy


async def test_size_limits_that_differ_from_the_jobs_are_refused_at_join(rdv):
    await running(rdv, min_world_size=2)
    with pytest.raises(WorldSizeMismatchError, match="has max_world_size 4, but this rank "
                                                     "asked for 5"):
        await rdv.join("r", 3, None, "x:1", timeout=BOUND, elastic=True, max_world_size=5)
    with pytest.raises(WorldSizeMismatchError, match="has min_world_size 2"):
        await rdv.join("r", 3, None, "x:1", timeout=BOUND, elastic=True, max_world_size=4,
                       min_world_size=1)
    assert rdv.jobs["r"].resize is None and rdv.jobs["r"].world_size == 3


async def test_a_resize_is_visible_in_admin_metrics_and_the_status_page(rdv):
    from gradstar.coordinator.metrics.prometheus import CollectiveMetrics, render
    from gradstar.coordinator.views.admin import job_summary

    await running(rdv, min_world_size=2)
    joiner = asyncio.ensure_future(rdv.join("r", 3, None, "10.0.0.9:1", timeout=BOUND,
                                            elastic=True))
    await asyncio.sleep(0)
    summary = job_summary(rdv.jobs["r"])
    assert (summary.min_world_size, summary.max_world_size, summary.resizes,
            summary.joining_at_boundary) == (2, 4, 0, 1)
    text = render(rdv, CollectiveMetrics())
    assert 'gradstar_job_joining_at_boundary{job="r"} 1' in text
    assert 'gradstar_job_max_world_size{job="r"} 4' in text
    assert 'gradstar_job_resizes_total{job="r"} 0' in text
    joiner.cancel()
