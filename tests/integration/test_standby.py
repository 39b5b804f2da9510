"""A standby coordinator takes over through etcd (``gradstar coordinator --ha``,
coordinator/leadership/): a real etcd on 127.0.0.1, coordinators as processes of their own,
the groups of a job in this process, given every coordinator's address. The Synchronous DDP
job across a takeover is tests/parallel/test_standby_ddp.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gradstar import errors
from gradstar.coordinator.leadership import Etcd, Leadership, Role, endpoints_of
from gradstar.worker.admin.client import AdminClient
from tests.runtime.conftest import http_get

from .conftest import close_all, etcd_server, join_all, next_line, spawn_standby

pytestmark = pytest.mark.timeout(180)

#: The leader's lease (seconds): a stopped leader is replaced within it (and a poll).
TTL = 2


@contextlib.asynccontextmanager
async def coordinators(tmp_path, count: int = 2, *flags: str):
    """A real etcd and ``count`` coordinators under ``--ha`` (the first one leads): yields
    the etcd URL and the [(process, address)] of the coordinators, killed afterwards."""
    async with etcd_server(tmp_path) as etcd:
        started = []
        try:
            for k in range(count):
                proc, address, role = await spawn_standby(etcd, "--ha-ttl", str(TTL), *flags)
                assert role == ("leader" if k == 0 else "standby"), (k, role)
                started.append((proc, address))
            yield etcd, started
        finally:
            for proc, _ in started:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGCONT)
                    proc.kill()
                await proc.wait()


async def health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status


async def test_a_standby_serves_no_job_and_names_the_leader(tmp_path):
    async with coordinators(tmp_path) as (_, [(_, leader), (_, standby)]):
        assert await health(leader) == health_pb2.HealthCheckResponse.SERVING
        assert await health(standby) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(errors.NotLeaderError) as named:  # given the standby alone
            await join_all(standby, 1, "alone", connect_timeout=3)
        assert named.value.leader == leader and f"the leader is at {leader}" in str(named.value)
        async with AdminClient(standby) as admin:
            view = await admin.leadership()
        assert (view.elected, view.role, view.leader) == (True, "standby", leader)
        # Given both, standby first, the ranks join the leader.
        groups = await join_all(f"{standby},{leader}", 2, "both")
        try:
            assert all(g.settings.coordinator == leader for g in groups)
            assert [float(r[0]) for r in await asyncio.gather(
                *(g.all_reduce(np.ones(3, np.float32)) for g in groups))] == [2.0, 2.0]
        finally:
            await close_all(groups)


async def reduce_across(groups, action) -> tuple[list[np.ndarray], np.ndarray]:
    """An all_reduce in place on every group, ``action()`` run while it is in flight (the
    coordinator's death): each rank's result and what every one must be."""
    inputs = [np.arange(40_000, dtype=np.float32) * (g.rank + 1) for g in groups]
    expected = sum(inputs)
    works = [asyncio.ensure_future(g.all_reduce(inputs[g.rank], out=inputs[g.rank]))
             for g in groups]
    await action()
    return await asyncio.wait_for(asyncio.gather(*works), 60), expected


async def test_a_standby_takes_over_from_a_killed_leader_mid_collective(tmp_path):
    async with coordinators(tmp_path, 2, "--metrics-port", "0") as (_, started):
        (old, leader), (new, standby) = started
        groups = await join_all(f"{leader},{standby}", 3, "takeover", reconnect_timeout=30)
        try:
            async def kill():
                old.kill()
                await old.wait()
                await asyncio.wait_for(next_line(new, "gradstar coordinator listening on "),
                                       TTL + 10)

            results, expected = await reduce_across(groups, kill)
            assert all(np.array_equal(r, expected) for r in results)
            for g in groups:
                assert g.settings.coordinator == standby and len(g.reconnects) == 1
            # The new leader's is the generation now, and what operators see says so.
            assert [float(r[0]) for r in await asyncio.gather(
                *(g.all_reduce(np.ones(2, np.float32)) for g in groups))] == [3.0] * 3
            async with AdminClient(standby) as admin:
                view = await admin.leadership()
            assert (view.role, view.leader, view.takeovers, view.rebuilds) == (
                "leader", standby, 1, 1)
            assert 0 < view.rejoin_wait_seconds <= max(w for g in groups for w in g.reconnects)
            metrics_port = await _metrics_port(new)
            _, _, page = await http_get(metrics_port, "/metrics")
            assert b"gradstar_leader 1\n" in page and b"gradstar_takeovers_total 1\n" in page
            _, _, status = await http_get(metrics_port, "/status.json")
            lead = json.loads(status)["leadership"]
            assert (lead["role"], lead["term"], lead["takeovers"]) == ("leader", view.term, 1)
            _, _, html = await http_get(metrics_port, "/")
            assert b"this coordinator leads" in html
        finally:
            await close_all(groups)


async def _metrics_port(proc) -> int:
    line = await asyncio.wait_for(next_line(proc, "gradstar coordinator metrics on "), 10)
    return int(line.rsplit(":", 1)[1].split("/")[0])


async def test_a_stopped_leader_loses_its_lease_and_stops_serving_when_it_wakes(tmp_path):
    """SIGSTOP (a partition, a long GC pause): the standby takes over within the lease TTL,
    the ranks follow it, and the old leader, woken, finds its lease gone before it serves
    anything, and exits by name; the job goes on on the new leader."""
    state = tmp_path / "state"
    async with coordinators(tmp_path, 2, "--state-dir", str(state)) as (_, started):
        (old, leader), (new, standby) = started
        groups = await join_all(f"{leader},{standby}", 2, "stopped", reconnect_timeout=40)
        try:
            loop = asyncio.get_running_loop()

            async def stop():
                old.send_signal(signal.SIGSTOP)
                stopped = loop.time()
                await asyncio.wait_for(next_line(new, "gradstar coordinator listening on "),
                                       TTL + 10)
                # The lease expires TTL s after the last renewal; the standby polls it.
                assert loop.time() - stopped < TTL + 4

            results, expected = await reduce_across(groups, stop)
            assert all(np.array_equal(r, expected) for r in results)
            assert all(g.settings.coordinator == standby for g in groups)
            old.send_signal(signal.SIGCONT)
            _, err = await asyncio.wait_for(old.communicate(), 20)
            assert old.returncode == 1, err.decode()[-2000:]
            assert ("gradstar coordinator: NotLeaderError: this coordinator no longer leads: "
                    "etcd let its lease expire") in err.decode(), err.decode()[-2000:]
            # Nothing of the woken one reached the ranks: they go on with the new leader.
            assert [float(r[0]) for r in await asyncio.gather(
                *(g.all_reduce(np.ones(2, np.float32)) for g in groups))] == [2.0, 2.0]
            assert all(len(g.reconnects) == 1 for g in groups)
        finally:
            await close_all(groups)


async def test_an_unreachable_etcd_is_named_at_start_not_a_hang(tmp_path):
    from benchmarks._etcd import free_port

    for url, named in ((f"etcd://127.0.0.1:{free_port()}", "ElectionUnavailableError: no "
                        "etcd endpoint of 127.0.0.1:"),
                       ("http://127.0.0.1:2379", "ConfigurationError: --ha 'http://127.0.0.1"
                        ":2379': expected etcd://HOST:PORT")):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gradstar", "coordinator", "--host", "127.0.0.1", "--port",
            "0", "--shards", "0", "--ha", url, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 1, err
        assert f"gradstar coordinator: {named}" in err.decode(), err.decode()
        assert b"listening on" not in out and b"standby on" not in out


async def test_a_leader_fences_itself_on_an_expired_lease_or_a_newer_term(tmp_path):
    """The election against a real etcd, in this process: a leader that stops renewing is
    replaced within its TTL, and then refuses to serve (NotLeaderError) and to write; one
    shown a newer term by a rank refuses it (StaleCoordinatorError). Both are fenced."""
    async with etcd_server(tmp_path) as etcd:
        endpoints, prefix = endpoints_of(etcd + "/fence")
        fenced: list[str] = []
        first = Leadership(Etcd(endpoints), prefix, "", TTL, on_fenced=fenced.append)
        second = Leadership(Etcd(endpoints), prefix, "", TTL)
        for lead, address in ((first, "a:1"), (second, "b:2")):
            await lead.connect()
            await lead.start(address)
        try:
            assert (first.role, second.role) == (Role.LEADER, Role.STANDBY)
            term = first.check()
            assert second.leader == "a:1" and second.term == term
            with pytest.raises(errors.NotLeaderError, match="the leader is at a:1"):
                second.check()
            first._task.cancel()  # it stops renewing its lease, as a stopped process does
            loop = asyncio.get_running_loop()
            began = loop.time()
            while second.role is not Role.LEADER:
                assert loop.time() - began < TTL + 3, "the standby did not take over"
                await asyncio.sleep(0.05)
            assert second.term > term and second.takeovers == 1
            with pytest.raises(errors.NotLeaderError, match=r"fenced .*lease of 2 s ran out"):
                first.guard()  # a write to the state directory, say
            assert first.role is Role.FENCED and len(fenced) == 1
            # A term newer than the leader's own, that etcd does not know: refused, not obeyed.
            with pytest.raises(errors.StaleCoordinatorError) as stale:
                second.check(seen=second.term + 1000)
            assert (stale.value.term, stale.value.seen) == (second.term, second.term + 1000)
            await asyncio.gather(*second._checks)
            assert second.role is Role.LEADER and second.check() == second.term
            # The first one, revived as a leader of its old term, is shown the newer one: etcd
            # names another leader, so it fences itself.
            first.role, first._valid_until = Role.LEADER, loop.time() + 60
            first.fenced_because = ""
            with pytest.raises(errors.StaleCoordinatorError):
                first.check(seen=second.term)
            await asyncio.gather(*first._checks)
            assert first.role is Role.FENCED and "etcd no longer names" in first.fenced_because
        finally:
            await first.stop()
            await second.stop()


async def test_an_orderly_stop_hands_the_lead_over_at_once(tmp_path):
    """SIGTERM revokes the lease: with a 30 s lease the standby leads within a poll (1 s),
    and the ranks, whose sessions the stop ends, follow it."""
    async with etcd_server(tmp_path) as etcd:
        hubs = [await spawn_standby(etcd, "--ha-ttl", "30")
                for _ in range(2)]
        try:
            (old, leader, _), (new, standby, role) = hubs
            assert role == "standby"
            groups = await join_all(f"{leader},{standby}", 2, "handover", reconnect_timeout=30)
            try:
                loop = asyncio.get_running_loop()
                began = loop.time()
                old.send_signal(signal.SIGTERM)
                await asyncio.wait_for(next_line(new, "gradstar coordinator listening on "), 10)
                assert loop.time() - began < 8  # not the 30 s lease: it was revoked
                assert await asyncio.wait_for(old.wait(), 20) == 0
                assert [float(r[0]) for r in await asyncio.gather(
                    *(g.all_reduce(np.ones(2, np.float32)) for g in groups))] == [2.0, 2.0]
                assert all(g.settings.coordinator == standby for g in groups)
            finally:
                await close_all(groups)
        finally:
            for proc, _, _ in hubs:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()


async def test_gradstar_admin_leader_names_the_leader_of_several(tmp_path):
    async with coordinators(tmp_path) as (_, [(_, leader), (_, standby)]):
        async def admin(*args: str) -> tuple[int, str]:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gradstar", "admin", *args, "--coordinator",
                f"{standby},{leader}", stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 30)
            return proc.returncode, out.decode() + err.decode()

        code, out = await admin("leader", "--json")
        assert code == 0, out
        views = json.loads(out)
        assert [(v["coordinator"], v["role"], v["leader"]) for v in views] == [
            (standby, "standby", leader), (leader, "leader", leader)]
        assert views[0]["term"] == views[1]["term"] > 0 and views[1]["takeovers"] == 0
        code, table = await admin("leader")
        assert code == 0 and table.splitlines()[0].split()[:3] == ["COORDINATOR", "ROLE",
                                                                   "LEADER"], table
        # The other actions, given the list, ask the one that leads.
        code, out = await admin("status", "--json", "--interval", "0")
        assert code == 0 and json.loads(out)["coordinator"] == leader, out


async def test_a_leader_cut_off_from_etcd_stops_leading_within_its_lease(tmp_path):
    """etcd gone (a partition between the leader and etcd): the leader cannot know whether a
    standby took over, so once its lease would have run out it counts itself fenced."""
    from benchmarks._etcd import start_etcd, stop_etcd

    proc, url = await asyncio.to_thread(start_etcd, tmp_path)
    endpoints, prefix = endpoints_of(url + "/cut")
    fenced: list[str] = []
    lead = Leadership(Etcd(endpoints, timeout=0.5), prefix, "", TTL, on_fenced=fenced.append)
    try:
        await lead.connect()
        await lead.start("a:1")
        assert lead.role is Role.LEADER
        await asyncio.to_thread(stop_etcd, proc)
        loop = asyncio.get_running_loop()
        began = loop.time()
        while lead.role is not Role.FENCED:
            assert loop.time() - began < TTL + 2, "still leading without etcd"
            await asyncio.sleep(0.05)
        assert len(fenced) == 1 and ("etcd could not be reached" in fenced[0]
                                     or "ran out" in fenced[0]), fenced
        with pytest.raises(errors.NotLeaderError):
            lead.check()
    finally:
        await asyncio.to_thread(stop_etcd, proc)
        await lead.stop()


async def test_a_join_waiting_on_a_leader_that_dies_goes_to_the_next(tmp_path):
    """A rank whose join the leader took (waiting for the job's other rank) when the leader
    was killed joins the next leader, however long it had waited: connect_timeout counts
    from the loss, not from the first try."""
    import gradstar

    async with coordinators(tmp_path) as (_, [(old, leader), (new, standby)]):
        def join(rank: int):
            return asyncio.ensure_future(gradstar.init_process_group_async(
                coordinator=f"{leader},{standby}", job="early", world_size=2, rank=rank,
                connect_timeout=5, join_timeout=60, timeout=20))

        early = join(0)
        await asyncio.sleep(6)  # past connect_timeout, its join held by the leader
        assert not early.done()
        old.kill()
        await old.wait()
        await asyncio.wait_for(next_line(new, "gradstar coordinator listening on "), TTL + 10)
        groups = await asyncio.wait_for(asyncio.gather(early, join(1)), 30)
        try:
            assert all(g.settings.coordinator == standby for g in groups)
            assert [float(r[0]) for r in await asyncio.gather(
                *(g.all_reduce(np.ones(2, np.float32)) for g in groups))] == [2.0, 2.0]
        finally:
            await close_all(groups)
