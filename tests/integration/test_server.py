"""The coordinator as operators see it: CLI, health, reflection, admin, drain, TLS."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import gradstar
from gradstar import errors
from gradstar.proto.v1 import admin_pb2, admin_pb2_grpc
from gradstar.proto.v1 import collective_pb2 as pb

from .certs import make_pki
from .conftest import close_all, join_all, until

TOKEN = "tok-3f9a7c1e5d"


async def health(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5)
    return reply.status


async def reflected_services(address: str) -> set[str]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for reply in stub.ServerReflectionInfo(iter([request]), timeout=5):
            return {s.name for s in reply.list_services_response.service}
    return set()


async def test_cli_coordinator_serves_health_reflection_and_hides_its_token():
    env = {**os.environ, "GRADSTAR_TOKEN": TOKEN}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gradstar", "coordinator", "--host", "127.0.0.1", "--port", "0",
        "--shards", "0", "--reflection", "--log-level", "DEBUG", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        assert line.startswith("gradstar coordinator listening on 127.0.0.1:"), line
        address = line.split()[-1]
        assert await health(address) == health_pb2.HealthCheckResponse.SERVING
        assert await health(address, "gradstar.proto.v1.Collective") == \
            health_pb2.HealthCheckResponse.SERVING
        assert {"gradstar.proto.v1.Rendezvous", "gradstar.proto.v1.Collective",
                "gradstar.proto.v1.Admin", "grpc.health.v1.Health"} <= \
            await reflected_services(address)
        async with await gradstar.init_process_group_async(
                coordinator=address, job="cli", world_size=1, token=TOKEN) as g:
            np.testing.assert_array_equal(await g.all_reduce(np.arange(3)), np.arange(3))
        proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.wait_for(proc.communicate(), 20)
        assert proc.returncode == 0, err.decode()[-2000:]
        logs = line + out.decode() + err.decode()
        assert "rank 0 joined" in logs  # the log is there...
        assert TOKEN not in logs  # ...and the token is not
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


async def test_cli_rejects_invalid_settings():
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gradstar", "coordinator", "--port", "70000",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 2
    assert "port" in err.decode() and "65535" in err.decode()


async def admin_stub(address: str):
    channel = grpc.aio.insecure_channel(address)
    return channel, admin_pb2_grpc.AdminStub(channel)


async def test_admin_shows_members_in_flight_ranks_and_counters(coordinator):
    groups = await join_all(coordinator.address, 3, job="watched")
    channel, admin = await admin_stub(coordinator.address)
    try:
        jobs = await admin.ListJobs(admin_pb2.ListJobsRequest(), timeout=5)
        assert [(j.job, j.world_size, j.members, j.state) for j in jobs.jobs] == \
            [("watched", 3, 3, "running")]
        pending = [asyncio.ensure_future(g.all_reduce(np.ones(1000))) for g in groups[:2]]
        # Until the hub (in this process) holds both ranks' arrivals, then ask the admin view.
        gen = coordinator.rendezvous.jobs["watched"].generation
        await until(lambda: [sorted(c.participants) for c in gen.collectives.values()] == [[0, 1]],
                    "ranks 0 and 1 arrived at the hub")
        detail = await admin.GetJob(admin_pb2.GetJobRequest(job="watched"), timeout=5)
        assert [m.rank for m in detail.members] == [0, 1, 2]
        (in_flight,) = detail.in_flight
        assert in_flight.op == pb.COLLECTIVE_OP_ALL_REDUCE
        assert list(in_flight.arrived_ranks) == [0, 1]
        assert list(in_flight.missing_ranks) == [2]
        await asyncio.wait_for(asyncio.gather(groups[2].all_reduce(np.ones(1000)), *pending), 10)
        detail = await admin.GetJob(admin_pb2.GetJobRequest(job="watched"), timeout=5)
        assert not detail.in_flight
        ops = {c.op: (c.completed, c.failed) for c in detail.ops}
        assert ops[pb.COLLECTIVE_OP_ALL_REDUCE] == (1, 0)
        assert detail.bytes_in >= 3 * 8000 and detail.bytes_out >= 3 * 8000
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await admin.GetJob(admin_pb2.GetJobRequest(job="nope"), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await channel.close()
        await close_all(groups)


async def test_drain_turns_not_serving_and_refuses_joins_but_running_jobs_finish(coordinator):
    groups = await join_all(coordinator.address, 2, job="running")
    channel, admin = await admin_stub(coordinator.address)
    try:
        reply = await admin.Drain(admin_pb2.DrainRequest(), timeout=5)
        assert reply.active_jobs == 1
        assert await health(coordinator.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(errors.CoordinatorDrainingError, match="draining"):
            await gradstar.init_process_group_async(
                coordinator=coordinator.address, job="late", world_size=1, join_timeout=5)
        results = await asyncio.wait_for(
            asyncio.gather(*(g.all_reduce(np.ones(4)) for g in groups)), 10)
        assert all(np.array_equal(r, np.full(4, 2.0)) for r in results)
    finally:
        await channel.close()
        await close_all(groups)


@pytest.fixture
def pki(tmp_path):
    return make_pki(tmp_path)


async def test_tls_coordinator_serves_tls_clients_only(start_coordinator, pki):
    coordinator = await start_coordinator(tls_cert=pki["server"], tls_key=pki["server_key"])
    async with await gradstar.init_process_group_async(
            coordinator=coordinator.address, job="tls", world_size=1, tls_ca=pki["ca"]) as g:
        np.testing.assert_array_equal(await g.all_reduce(np.ones(3)), np.ones(3))
    with pytest.raises(errors.CoordinatorUnavailableError, match="TLS"):
        await gradstar.init_process_group_async(
            coordinator=coordinator.address, job="plain", world_size=1, connect_timeout=2)


async def test_mutual_tls_requires_a_client_certificate(start_coordinator, pki):
    coordinator = await start_coordinator(tls_cert=pki["server"], tls_key=pki["server_key"],
                                          tls_client_ca=pki["ca"])
    with pytest.raises(errors.CoordinatorUnavailableError):
        await gradstar.init_process_group_async(
            coordinator=coordinator.address, job="anon", world_size=1, tls_ca=pki["ca"],
            connect_timeout=2)
    async with await gradstar.init_process_group_async(
            coordinator=coordinator.address, job="mtls", world_size=1, tls_ca=pki["ca"],
            tls_cert=pki["client"], tls_key=pki["client_key"]) as g:
        np.testing.assert_array_equal(await g.all_reduce(np.ones(3)), np.ones(3))
