"""A sharded hub: K shard processes carry the stripes of every collective.

Real coordinator on 127.0.0.1:0, real ``python -m gradstar shard`` processes, ranks as
AsyncProcessGroups in this process (real sockets). Inputs are small integers, in every dtype,
so every sum and product is exact whatever order the hub folds ranks in: results must be
bit-identical with and without shards.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time

import grpc
import ml_dtypes
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gradstar import errors
from gradstar.coordinator.shards.registry import probe, probes_caller
from gradstar.proto.v1 import admin_pb2, admin_pb2_grpc
from gradstar.transport.auth import bearer

from .conftest import close_all, join_all

WORLD = 3
DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int32, np.int64]
# 256-byte chunks: a few hundred elements make many chunks, so every shard gets several, with
# a short last chunk; 5 x 37 elements do not divide evenly by anything here.
CHUNK_BYTES = 256
SHAPE = (5, 37)


def exact_inputs(dtype, shape, world=WORLD, seed=7):
    rng = np.random.default_rng(seed)
    return [rng.integers(-6, 7, size=shape).astype(dtype) for _ in range(world)]


async def run_every_collective(address: str, dtype, job: str, offers: list | None = None,
                               **options) -> dict:
    """Every collective of the SDK on ``exact_inputs``; {name: per-rank results}. The ranks'
    shared-memory offers to their targets, as they stand at the end, go into ``offers``."""
    groups = await join_all(address, WORLD, job=job, chunk_bytes=CHUNK_BYTES, **options)
    try:
        xs = exact_inputs(dtype, SHAPE)
        rs = exact_inputs(dtype, (WORLD * 4, 7), seed=8)
        out = {}
        for op in ("sum", "mean", "min", "max", "prod"):
            if op == "mean" and np.dtype(dtype).kind == "i":
                continue
            out[f"all_reduce/{op}"] = await asyncio.gather(
                *(g.all_reduce(x, op) for g, x in zip(groups, xs, strict=True)))
        out["broadcast"] = await asyncio.gather(
            *(g.broadcast(x, src=1) for g, x in zip(groups, xs, strict=True)))
        out["all_gather"] = await asyncio.gather(
            *(g.all_gather(x) for g, x in zip(groups, xs, strict=True)))
        out["reduce_scatter"] = await asyncio.gather(
            *(g.reduce_scatter(r, "sum") for g, r in zip(groups, rs, strict=True)))
        out["one_element"] = await asyncio.gather(
            *(g.all_reduce(x.reshape(-1)[:1], "max") for g, x in zip(groups, xs, strict=True)))
        await asyncio.gather(*(g.barrier() for g in groups))
        if offers is not None:
            offers.extend(t.shm for g in groups for t in g._plane.targets())
            assert all(g.shared_memory is all(t.shm.enabled for t in g._plane.targets())
                       for g in groups)
        return out
    finally:
        await close_all(groups)


def as_bytes(results) -> list:
    return [[a.tobytes() for a in r] if isinstance(r, list) else r.tobytes() for r in results]


@pytest.mark.parametrize("shards", [1, 2, 3])
async def test_every_collective_is_bit_identical_to_the_single_hub(start_coordinator, shards):
    single = await start_coordinator()
    sharded = await start_coordinator(shards=shards)
    assert len(sharded.shards.up) == shards
    for dtype in DTYPES:
        want = await run_every_collective(single.address, dtype, f"single-{np.dtype(dtype)}")
        got = await run_every_collective(sharded.address, dtype, f"sharded-{np.dtype(dtype)}")
        assert got.keys() == want.keys()
        for name in want:
            assert as_bytes(got[name]) == as_bytes(want[name]), (name, np.dtype(dtype))
        # The exact reference, so "identical" cannot mean "identically wrong".
        xs = exact_inputs(dtype, SHAPE)
        np.testing.assert_array_equal(got["all_reduce/sum"][0], sum(xs))
    # Every shard carried bytes: the collectives really were striped.
    async with admin(sharded.address) as stub:
        listed = await stub.ListShards(admin_pb2.ListShardsRequest(), timeout=5)
    assert [s.state for s in listed.shards] == ["up"] * shards
    await wait_for(lambda: all(s.stats.bytes_in > 0 for s in sharded.shards.up), 5)


async def test_a_one_chunk_tensor_uses_one_shard(start_coordinator):
    coordinator = await start_coordinator(shards=2)
    groups = await join_all(coordinator.address, 2, job="small")
    try:
        results = await asyncio.gather(*(g.all_reduce(np.ones(8, np.float32)) for g in groups))
        np.testing.assert_array_equal(results[0], np.full(8, 2, np.float32))
    finally:
        await close_all(groups)
    await wait_for(lambda: coordinator.shards.slots[0].stats.bytes_in > 0, 5)
    assert coordinator.shards.slots[1].stats.bytes_in == 0


async def test_a_killed_shard_fails_every_rank_with_a_named_error_within_5_s(start_coordinator):
    coordinator = await start_coordinator(shards=2)
    groups = await join_all(coordinator.address, WORLD, job="doomed", timeout=60)
    try:
        # A large all_reduce that one rank never joins keeps every other stream mid-flight.
        x = np.ones(4 << 20, np.float32)
        pending = [asyncio.ensure_future(g.all_reduce(x)) for g in groups[:-1]]
        await asyncio.sleep(0.5)
        victim = coordinator._local_shards.processes[1]
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        outcomes = await asyncio.wait_for(
            asyncio.gather(*pending, return_exceptions=True), 10)
        elapsed = time.monotonic() - killed
        for outcome in outcomes:
            assert isinstance(outcome, errors.ShardLostError), outcome
            assert outcome.shard == 1 and "hub shard 1" in str(outcome)
        assert elapsed < 5, elapsed
        # The rank that never called also learns it at its next collective.
        with pytest.raises(errors.ShardLostError):
            await groups[-1].all_reduce(x)
    finally:
        await close_all(groups)
    # The coordinator restarts its local shard, which takes its slot back; a new generation
    # stripes over both again and works.
    await wait_for(lambda: len(coordinator.shards.up) == 2, 15)
    assert await health(coordinator.address) == "SERVING"
    groups = await join_all(coordinator.address, 2, job="after")
    try:
        results = await asyncio.gather(*(g.all_reduce(np.arange(1000.0)) for g in groups))
        np.testing.assert_array_equal(results[1], 2 * np.arange(1000.0))
    finally:
        await close_all(groups)


async def test_a_rank_that_finishes_fails_striped_collectives_naming_it(start_coordinator):
    coordinator = await start_coordinator(shards=2)
    groups = await join_all(coordinator.address, WORLD, job="early", chunk_bytes=CHUNK_BYTES)
    try:
        # Mid-flight on both shards: the last rank closes instead of calling all_reduce.
        x = np.ones(1 << 16, np.float32)
        pending = [asyncio.ensure_future(g.all_reduce(x)) for g in groups[:-1]]
        await asyncio.sleep(0.3)
        await groups[-1].close()
        outcomes = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 5)
        for outcome in outcomes:
            assert isinstance(outcome, errors.RankFinishedError), outcome
            assert outcome.rank == WORLD - 1 and "finished" in str(outcome)
        # The generation is still healthy for the others: peer traffic goes on.
        y = np.arange(3.0)
        _, got = await asyncio.gather(groups[0].send(y, dst=1), groups[1].recv(src=0))
        np.testing.assert_array_equal(got, y)
    finally:
        await close_all(groups)
    assert coordinator.rendezvous.jobs["early"].state == "completed"


async def test_a_lost_shard_is_reported_and_turns_the_coordinator_not_serving(
        start_coordinator):
    # A coordinator that expects one shard does not start serving without it...
    with pytest.raises(OSError, match="only 0 of 1 hub shards registered within"):
        await start_coordinator(expected_shards=1, shard_wait=0.5)
    # ...and with a shard started by hand (nobody restarts it), it reports the loss.
    coordinator = await start_coordinator()
    coordinator.shards.expected = 1
    shard = await start_shard(coordinator.address, env={})
    await wait_for(lambda: len(coordinator.shards.up) == 1, 20)
    await wait_for_health(coordinator.address, "SERVING")
    shard.kill()
    await asyncio.wait_for(shard.wait(), 10)
    await wait_for_health(coordinator.address, "NOT_SERVING")
    async with admin(coordinator.address) as stub:
        listed = await stub.ListShards(admin_pb2.ListShardsRequest(), timeout=5)
    assert [(s.slot, s.state) for s in listed.shards] == [(0, "lost")]
    assert listed.expected == 1


async def test_a_shard_started_by_hand_registers_serves_and_is_reported(start_coordinator,
                                                                        tmp_path):
    coordinator = await start_coordinator(token="job-secret", admin_token="admin-secret")
    assert await health(coordinator.address) == "SERVING"  # no shard expected
    shard = await start_shard(coordinator.address, env={"GRADSTAR_TOKEN": "job-secret",
                                                        "GRADSTAR_ADMIN_TOKEN": "admin-secret"})
    try:
        await wait_for(lambda: len(coordinator.shards.up) == 1, 20)
        groups = await join_all(coordinator.address, 2, job="remote", token="job-secret",
                                chunk_bytes=4096)
        try:
            assert all(g.shards == [coordinator.shards.up[0].address] for g in groups)
            results = await asyncio.gather(*(g.all_gather(np.full(3000, g.rank, np.int64))
                                             for g in groups))
            np.testing.assert_array_equal(results[0][1], np.full(3000, 1))
        finally:
            await close_all(groups)
        await wait_for(lambda: coordinator.shards.up[0].stats.bytes_in > 0, 5)
        async with admin(coordinator.address, "admin-secret") as stub:
            listed = await stub.ListShards(admin_pb2.ListShardsRequest(), timeout=5)
            job = await stub.GetJob(admin_pb2.GetJobRequest(job="remote"), timeout=5)
        assert [(s.slot, s.state) for s in listed.shards] == [(0, "up")]
        assert listed.shards[0].bytes_in >= 2 * 3000 * 8
        assert job.bytes_in >= 2 * 3000 * 8  # the shard's traffic counts for the job
    finally:
        shard.send_signal(signal.SIGTERM)
        await asyncio.wait_for(shard.wait(), 10)


async def test_a_shard_with_the_wrong_token_is_refused(start_coordinator):
    coordinator = await start_coordinator(token="job-secret", admin_token="admin-secret")
    shard = await start_shard(coordinator.address, env={"GRADSTAR_TOKEN": "job-secret",
                                                        "GRADSTAR_ADMIN_TOKEN": "wrong"})
    _, err = await asyncio.wait_for(shard.communicate(), 30)
    assert shard.returncode == 1
    assert "refused" in err.decode() and "admin token wrong" in err.decode()
    assert coordinator.shards.slots == {}


# -- helpers -----------------------------------------------------------------------------------


async def start_shard(coordinator: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GRADSTAR_")}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gradstar", "shard", "--coordinator", coordinator,
        "--host", "127.0.0.1", "--port", "0", env={**base, **env},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)


class admin:
    """``async with admin(address, token) as stub``: an Admin stub with the token attached."""

    def __init__(self, address: str, token: str | None = None) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.metadata = bearer(token) if token else ()

    async def __aenter__(self):
        stub = admin_pb2_grpc.AdminStub(self.channel)
        metadata = self.metadata

        class Stub:
            async def ListShards(self, request, timeout):
                return await stub.ListShards(request, timeout=timeout, metadata=metadata)

            async def GetJob(self, request, timeout):
                return await stub.GetJob(request, timeout=timeout, metadata=metadata)

        return Stub()

    async def __aexit__(self, *exc):
        await self.channel.close()


async def health(address: str) -> str:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def wait_for_health(address: str, status: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while (now := await health(address)) != status:
        if time.monotonic() > deadline:
            raise AssertionError(f"health stayed {now}, expected {status}")
        await asyncio.sleep(0.05)


async def wait_for(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.05)


async def test_checks_hold_on_every_shard_and_averaging_stays_on_the_coordinator(
        start_coordinator):
    coordinator = await start_coordinator(shards=2, token="job-secret")
    groups = await join_all(coordinator.address, 2, job="checks", token="job-secret",
                            chunk_bytes=1024)
    try:
        # A mismatch is caught by the shards as by the single hub, on every rank.
        outcomes = await asyncio.gather(
            groups[0].all_reduce(np.ones(4096, np.float32)),
            groups[1].all_reduce(np.ones(4095, np.float32)), return_exceptions=True)
        for outcome in outcomes:
            assert isinstance(outcome, errors.CollectiveMismatchError), outcome
            assert "shape differs" in str(outcome)
        # Collectives through the shards and averaging rounds through the coordinator share
        # one sequence of collectives; both work, in any mix.
        params = [np.full(3000, float(g.rank), np.float32) for g in groups]
        averaged = await asyncio.gather(*(g.sync_global_model(p, model="m", rule="average")
                                          for g, p in zip(groups, params, strict=True)))
        np.testing.assert_array_equal(averaged[0], np.full(3000, 0.5, np.float32))
        sums = await asyncio.gather(*(g.all_reduce(p) for g, p in zip(groups, params,
                                                                       strict=True)))
        np.testing.assert_array_equal(sums[1], np.ones(3000, np.float32))
    finally:
        await close_all(groups)
    # The global model lives on the coordinator, not on a shard.
    np.testing.assert_array_equal(coordinator.averaging.models("checks")["m"].params,
                                  np.full(3000, 0.5, np.float32))
    # A shard checks the job token like the coordinator does.
    shard = coordinator.shards.up[0].address.replace(":", "127.0.0.1:", 1)
    async with grpc.aio.insecure_channel(shard) as channel:
        call = channel.stream_stream("/gradstar.proto.v1.Collective/Stream")(
            metadata=bearer("wrong"), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call.read()
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_shards_show_in_metrics_and_in_gradstar_admin(start_coordinator):
    coordinator = await start_coordinator(shards=2, metrics_port=0)
    groups = await join_all(coordinator.address, 2, job="seen", chunk_bytes=1024)
    try:
        await asyncio.gather(*(g.all_reduce(np.ones(8192, np.float32)) for g in groups))
    finally:
        await close_all(groups)
    # Shards report every second: wait for the reports that follow the collective.
    await wait_for(lambda: coordinator.shards.job_totals("seen")[0] == 2 * 8192 * 4
                   and coordinator.shards.job_totals("seen")[2] == {1: 1}, 5)
    reader, writer = await asyncio.open_connection("127.0.0.1", coordinator.metrics_port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    page = (await asyncio.wait_for(reader.read(), 5)).decode()
    writer.close()
    for slot, record in coordinator.shards.slots.items():
        labels = f'{{shard="{slot}",address="{record.address}"}}'
        assert f"gradstar_shard_up{labels} 1" in page
        assert f"gradstar_shard_bytes_received_total{labels} {record.stats.bytes_in}" in page
    assert 'gradstar_bytes_received_total{job="seen"} 65536' in page
    assert 'gradstar_collectives_completed_total{job="seen",op="all_reduce"} 1' in page
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gradstar", "admin", "shards", "--coordinator",
        coordinator.address, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if not k.startswith("GRADSTAR_")})
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    assert lines[0] == "2 hub shard(s) up of 2 expected"
    assert lines[1].split() == ["SLOT", "ADDRESS", "STATE", "IN", "OUT", "REPORTED", "JOBS"]
    assert [line.split()[:3] for line in lines[2:]] == [
        [str(s), r.address, "up"] for s, r in sorted(coordinator.shards.slots.items())]


async def test_a_stalled_shard_fails_every_rank_with_a_named_error_within_7_s(start_coordinator):
    coordinator = await start_coordinator()
    shard = await start_shard(coordinator.address, env={})
    try:
        await wait_for(lambda: len(coordinator.shards.up) == 1, 20)
        groups = await join_all(coordinator.address, 2, job="stalled", timeout=60)
        try:
            x = np.ones(16 << 20, np.float32)
            await asyncio.gather(*(g.all_reduce(x[:8]) for g in groups))  # works before
            pending = [asyncio.ensure_future(g.all_reduce(x)) for g in groups]
            await asyncio.sleep(0)
            shard.send_signal(signal.SIGSTOP)  # alive, but answers nothing: not even pings
            stalled = time.monotonic()
            outcomes = await asyncio.wait_for(
                asyncio.gather(*pending, return_exceptions=True), 15)
            elapsed = time.monotonic() - stalled
        finally:
            await close_all(groups)
        # Either every rank completed before the stall took hold, or every rank got the named
        # error in time; never a hang or a partial result.
        if all(isinstance(o, np.ndarray) for o in outcomes):
            pytest.fail("the all_reduce finished before the shard stopped; make it larger")
        for outcome in outcomes:
            assert isinstance(outcome, errors.ShardLostError), outcome
        # keepalive: a ping every 1 s, unanswered for 4 s (KEEPALIVE_TIMEOUT_MS, which a lossy
        # far path needs); 5.0 s measured
        assert elapsed < 7, elapsed
        assert coordinator.shards.slots[0].state == "lost"
    finally:
        shard.send_signal(signal.SIGCONT)
        shard.kill()
        await asyncio.wait_for(shard.wait(), 10)


async def test_the_probe_finds_an_outbound_only_address_and_a_reachable_one():
    """The coordinator's probe, against a listener and a port that drops the connection."""
    async def run() -> tuple[bool, bool]:
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        with socket.socket() as unused:
            unused.bind(("127.0.0.1", 0))
            closed = unused.getsockname()[1]  # bound, not listening: refused
        async with server:
            return (await probe(f"127.0.0.1:{port}"), await probe(f"127.0.0.1:{closed}"))

    assert await run() == (True, False)


def test_the_probe_dials_only_the_registering_shards_own_host():
    assert probes_caller("10.0.0.2:4000", "ipv4:10.0.0.2:51234")
    assert probes_caller("[::1]:4000", "ipv6:[::1]:51234")
    assert not probes_caller("10.0.0.9:4000", "ipv4:10.0.0.2:51234")  # someone else's host
    assert not probes_caller("shard.example:4000", "ipv4:10.0.0.2:51234")
    assert not probes_caller(":4000", "ipv4:10.0.0.2:51234")  # the coordinator's own host
    assert not probes_caller("10.0.0.2:4000", "unix:/tmp/s")
