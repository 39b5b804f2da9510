"""Ranks ride through a restart of their coordinator (client/reconnect.py,
coordinator/rendezvous/rebuild.py): real coordinators on 127.0.0.1, stopped and started again on
the same port, with the groups of a job in this process. The kill -9 of a coordinator process
under Synchronous DDP is tests/integration/test_ride_through_processes.py."""

from __future__ import annotations

import asyncio
import json

import grpc
import numpy as np
import pytest

import gradstar
from gradstar import errors
from gradstar.coordinator import Coordinator
from gradstar.errors import ERROR_NAME_KEY
from gradstar.proto.v1 import rendezvous_pb2 as rpb
from gradstar.proto.v1 import rendezvous_pb2_grpc
from gradstar.worker.admin.client import AdminClient
from gradstar.worker.admin.tables import job_status
from tests.runtime.conftest import http_get

from .conftest import close_all, join_all, until


async def restart(start, coordinator: Coordinator, pause: float = 0.5,
                  **settings) -> Coordinator:
    """Stop ``coordinator`` and, ``pause`` seconds later, start another on its port with
    ``start`` (the ``start_coordinator`` fixture, which stops it after the test)."""
    port = coordinator.port
    await coordinator.stop(grace=0)
    await asyncio.sleep(pause)
    return await start(port=port, **settings)


async def test_collectives_in_flight_complete_after_the_coordinator_restarts(start_coordinator):
    first = await start_coordinator()
    groups = await join_all(first.address, 3, "ride", reconnect_timeout=20)
    try:
        inputs = [np.arange(50_000, dtype=np.float32) * (g.rank + 1) for g in groups]
        expected = sum(inputs)
        assert all(np.array_equal(r, expected) for r in await asyncio.gather(
            *(g.all_reduce(inputs[g.rank]) for g in groups)))
        groups[0]._session.send(rpb.SessionRequest(boundaries=True))  # as a Synchronous DDP
        await until(lambda: first.rendezvous.jobs["ride"].generation.members[0].boundaries,
                    "rank 0 said it moves at step boundaries", 10)
        # Stopped with nothing in flight: the next collectives are issued while it is away.
        port = first.port
        await first.stop(grace=0)
        in_place = [inputs[g.rank].copy() for g in groups]
        works = [asyncio.ensure_future(asyncio.gather(
            g.all_reduce(in_place[g.rank], out=in_place[g.rank]),
            g.broadcast(np.full(7, g.rank, np.int64), src=2),
            g.all_gather(np.full(3, g.rank, np.float64)))) for g in groups]
        await asyncio.sleep(0.5)
        second = await start_coordinator(port=port, metrics_port=0)
        results = await asyncio.wait_for(asyncio.gather(*works), 40)
        for g, (reduced, broadcast, gathered) in zip(groups, results, strict=True):
            assert reduced is in_place[g.rank]
            assert np.array_equal(reduced, expected), g.rank  # in place, yet every input whole
            assert np.array_equal(broadcast, np.full(7, 2, np.int64))
            assert [int(x[0]) for x in gathered] == [0, 1, 2]
            assert len(g.reconnects) == 1 and g.reconnects[0] > 0.4
            assert g.generation == 1 and g.collective_address.endswith(
                f":{second.collective_port}")
        # The rebuilt generation is the job's current one, and the next collective just works.
        rebuilt = second.rendezvous.jobs["ride"].generation
        assert rebuilt.number == 1
        # What the ranks said of step boundaries, they said again (a joiner past the world size
        # would wait for it): rank 0 had said it moves at them, the others said nothing.
        await until(lambda: rebuilt.members[0].boundaries, "rank 0 said it again", 10)
        assert [m.boundaries for _, m in sorted(rebuilt.members.items())] == [True, None, None]
        assert all(float(r[0]) == 6.0 for r in await asyncio.gather(
            *(g.all_reduce(np.ones(4, np.float32) * 2) for g in groups)))
        # What operators see of it: the status page, the metrics, gradstar admin.
        waited = max(w for g in groups for w in g.reconnects)
        _, _, status = await http_get(second.metrics_port, "/status.json")
        job = next(j for j in json.loads(status)["jobs"] if j["name"] == "ride")
        assert job["rebuilds"] == 1 and 0.4 < job["rejoin_wait_seconds"] <= waited + 0.5
        _, _, html = await http_get(second.metrics_port, "/")
        assert b'data-rebuilds-of="ride"' in html
        _, _, page = await http_get(second.metrics_port, "/metrics")
        assert b'gradstar_job_rebuilds_total{job="ride"} 1' in page
        async with AdminClient(second.address) as admin:
            detail = await admin.job("ride")
        assert detail.rebuilds == 1 and detail.rejoin_wait_seconds == job["rejoin_wait_seconds"]
        assert "rebuilt      1 time(s) after coordinator restarts" in job_status(detail)
    finally:
        await close_all(groups)


@pytest.mark.parametrize(("reconnect", "error"), [
    (1.5, errors.CoordinatorLostError),  # rejoins for 1.5 s, then fails by name
    (0.0, errors.CoordinatorUnavailableError),  # rides through nothing: at once, as before
])
async def test_a_coordinator_that_stays_away_fails_collectives_with_a_named_error(
        coordinator, reconnect, error):
    groups = await join_all(coordinator.address, 2, "gone", reconnect_timeout=reconnect)
    try:
        await coordinator.stop(grace=0)

        async def reduce(g):  # without reconnecting, the call itself may raise
            return await g.all_reduce(np.ones(8, np.float32))

        outcomes = await asyncio.wait_for(asyncio.gather(
            *(reduce(g) for g in groups), return_exceptions=True), 30)
        for outcome in outcomes:
            assert type(outcome) is error, outcome
            assert coordinator.address in str(outcome)
            if reconnect:
                assert "did not take rank" in str(outcome) and "1.5 s" in str(outcome)
        with pytest.raises(error):  # and every later one
            await groups[0].barrier()
    finally:
        await close_all(groups)


async def rejoin(address: str, job: str, world_size: int, rank: int, claim: rpb.Rejoin,
                 timeout: float = 5.0) -> tuple[str, str]:
    """One raw rejoin on a session stream: the error class the coordinator names (or "joined")
    and its message."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = rendezvous_pb2_grpc.RendezvousStub(channel)

        async def requests():
            yield rpb.SessionRequest(join=rpb.JoinRequest(
                job=job, world_size=world_size, rank=rank, timeout_seconds=timeout,
                rejoin=claim))
            await asyncio.sleep(timeout + 5)

        call = stub.Session(requests(), timeout=timeout + 5)
        try:
            event = await call.read()
        except grpc.aio.AioRpcError as error:
            trailing = dict(error.trailing_metadata() or ())
            return trailing.get(ERROR_NAME_KEY, error.code().name), error.details()
        finally:
            call.cancel()
        return event.WhichOneof("kind"), ""


async def test_rejoins_a_coordinator_cannot_take_back_are_refused_by_name(coordinator):
    address = coordinator.address
    claim = rpb.Rejoin(generation=2, member_id="m0", next_seq=5, pending=[4], retained=[3])
    # Sequence numbers that cannot be: a pending seq at the next seq, one pending and retained.
    for bad in (rpb.Rejoin(generation=2, member_id="m0", next_seq=4, pending=[4]),
                rpb.Rejoin(generation=2, member_id="m0", next_seq=5, pending=[3],
                           retained=[3]),
                rpb.Rejoin(generation=0, member_id="m0", next_seq=1)):
        name, message = await rejoin(address, "seqs", 2, 0, bad)
        assert name == "RejoinRefusedError", (name, message)
    assert "job" not in json.dumps(list(coordinator.rendezvous.jobs))  # nothing was made
    # Two ranks that disagree on the generation: the rebuild can never complete.
    first = asyncio.ensure_future(rejoin(address, "split", 2, 0, claim, timeout=10))
    await asyncio.sleep(0.3)
    other = rpb.Rejoin(generation=3, member_id="m1", next_seq=5, pending=[4])
    name, message = await rejoin(address, "split", 2, 1, other)
    assert name == "RejoinRefusedError" and "generation 3" in message, message
    assert (await first)[0] == "RejoinRefusedError"
    # A rank completed seq 3 and dropped it, while the other still waits for it.
    first = asyncio.ensure_future(rejoin(address, "dropped", 2, 0, claim, timeout=10))
    await asyncio.sleep(0.3)
    ahead = rpb.Rejoin(generation=2, member_id="m1", next_seq=9, pending=[8])
    name, message = await rejoin(address, "dropped", 2, 1, ahead)
    assert name == "RejoinRefusedError", message
    assert "rank 1" in message and "seq 4" in message, message
    assert (await first)[0] == "RejoinRefusedError"


async def test_a_rejoin_to_a_coordinator_that_holds_the_job_is_refused(coordinator):
    groups = await join_all(coordinator.address, 2, "held", reconnect_timeout=0)
    try:
        g = groups[0]
        claim = rpb.Rejoin(generation=g.generation, member_id=g.member_id, next_seq=1)
        name, message = await rejoin(coordinator.address, "held", 2, 0, claim)
        assert name == "RejoinRefusedError" and "holds the job at generation 1" in message
        assert all(float(r[0]) == 2.0 for r in await asyncio.gather(
            *(x.all_reduce(np.ones(2, np.float32)) for x in groups)))  # untouched
    finally:
        await close_all(groups)


async def test_the_direct_lane_rides_through_a_restart(start_coordinator):
    first = await start_coordinator()
    loop = asyncio.get_running_loop()
    pgs = await asyncio.gather(*(loop.run_in_executor(None, lambda r=r: gradstar.init_process_group(
        coordinator=first.address, job="direct", world_size=2, rank=r, timeout=20,
        reconnect_timeout=20)) for r in range(2)))
    try:
        assert all(pg._group.direct is not None for pg in pgs)
        port = first.port
        await first.stop(grace=0)
        calls = [loop.run_in_executor(None, lambda pg=pg: pg.all_reduce(
            np.full(16, pg.rank + 1.0, np.float32))) for pg in pgs]
        await asyncio.sleep(0.5)
        await start_coordinator(port=port)
        for result in await asyncio.wait_for(asyncio.gather(*calls), 40):
            assert np.array_equal(result, np.full(16, 3.0, np.float32))
        after = await asyncio.wait_for(asyncio.gather(*(loop.run_in_executor(
            None, lambda pg=pg: pg.all_reduce(np.ones(4, np.float32))) for pg in pgs)), 30)
        assert all(float(r[0]) == 2.0 for r in after)
    finally:
        await asyncio.gather(*(loop.run_in_executor(None, pg.close) for pg in pgs))


async def outer_round(groups, pseudo: list[np.ndarray], **kw):
    return await asyncio.gather(*(g.sync_global_model(
        pseudo[g.rank], model="m", rule="outer_sgd", outer_lr=0.5, **kw) for g in groups))


async def test_outer_rounds_ride_through_a_restart_with_the_state_dir(start_coordinator,
                                                                      tmp_path):
    first = await start_coordinator(state_dir=tmp_path)
    groups = await join_all(first.address, 2, "outer", reconnect_timeout=20)
    try:
        seed = np.linspace(0, 1, 1000, dtype=np.float32)
        await asyncio.gather(*(g.sync_global_model(seed, model="m", rule="seed")
                               for g in groups))
        pseudo = [np.full(1000, r + 1.0, np.float32) for r in range(2)]
        after_one = (await outer_round(groups, pseudo))[0]
        assert np.array_equal(after_one, seed - np.float32(0.5) * np.float32(1.5))
        port = first.port
        await first.stop(grace=0)
        # A round issued while the coordinator is away completes on the restarted one, which
        # read the global model from the state directory: one outer step on it, not two.
        pending = asyncio.ensure_future(outer_round(groups, pseudo))
        await asyncio.sleep(0.5)
        second = await start_coordinator(port=port, state_dir=tmp_path)
        results = await asyncio.wait_for(pending, 40)
        want = after_one - np.float32(0.5) * np.float32(1.5)
        assert all(np.array_equal(r, want) for r in results)
        assert second.averaging.get("outer", "m").rounds == 2
    finally:
        await close_all(groups)


async def test_outer_rounds_without_a_state_dir_fail_by_name_after_a_restart(
        start_coordinator):
    first = await start_coordinator()
    groups = await join_all(first.address, 2, "no-state", reconnect_timeout=20)
    try:
        seed = np.zeros(10, np.float32)
        await asyncio.gather(*(g.sync_global_model(seed, model="m", rule="seed")
                               for g in groups))
        await restart(start_coordinator, first)
        pseudo = [np.ones(10, np.float32)] * 2
        outcomes = await asyncio.wait_for(asyncio.gather(*(g.sync_global_model(
            pseudo[g.rank], model="m", rule="outer_sgd", outer_lr=0.5) for g in groups),
            return_exceptions=True), 40)
        for outcome in outcomes:
            assert isinstance(outcome, errors.InvalidCollectiveError), outcome
            assert "restarted without --state-dir" in str(outcome)
    finally:
        await close_all(groups)
