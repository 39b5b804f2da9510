"""The blocking API's direct lane: small collectives issued and waited for on the caller's own
thread (gradstar.client.collective.direct), in real rank processes against a real coordinator.
Exact for every dtype, op and collective; the hub's errors and a lost rank or hub named as on
the asyncio path, never a hang."""

from __future__ import annotations

import signal

import pytest

from .certs import make_pki
from .conftest import finish, spawn_ranks
from .test_multiprocess import (
    HEARTBEAT,
    SOON,
    last_json,
    ranks_named_a_lost_coordinator,
    survivors_of_a_lost_rank,
)

TINY = "25"  # float32 elements: a 100-byte all_reduce


@pytest.mark.parametrize("mode", ["open", "job token", "TLS"])
async def test_small_collectives_run_on_the_callers_thread_and_are_exact(start_coordinator,
                                                                          tmp_path, mode):
    # With a job token, every call on the lane must present it (the hub's interceptor refuses
    # any call without it); with TLS, the lane's streams (each on a completion queue of its
    # own) ride the channel's TLS as every other call.
    settings, env = {}, {}
    if mode == "job token":
        settings["token"] = env["GRADSTAR_TOKEN"] = "job-token"
    if mode == "TLS":
        pki = make_pki(tmp_path)
        settings = {"tls_cert": pki["server"], "tls_key": pki["server_key"]}
        env["GRADSTAR_TLS_CA"] = str(pki["ca"])
    coordinator = await start_coordinator(**settings)
    procs = await spawn_ranks("small_collectives", coordinator.address, 3, "direct", **env)
    reports = []
    for code, out, err in [await finish(p, 120) for p in procs]:
        assert code == 0, err[-2000:]
        reports.append(last_json(out))
    for report in reports:
        failed = [name for name, ok in report["checks"].items() if not ok]
        assert not failed, report
        # Every blocking small collective took the lane; the async_op one ran on the loop.
        assert report["direct"] == report["calls"], report


async def test_small_collectives_that_disagree_fail_on_every_rank_with_the_named_error(
        coordinator):
    procs = await spawn_ranks("small_mismatch", coordinator.address, 2, "direct-mismatch")
    for code, out, err in [await finish(p, 60) for p in procs]:
        assert code == 0, err[-2000:]
        report = last_json(out)
        assert report["mismatch"]["error"] == "CollectiveMismatchError", report
        assert "shape" in report["mismatch"]["message"], report
        assert report["after"], report  # a failed collective leaves the lane usable


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
async def test_rank_lost_mid_small_allreduce_fails_survivors_before_any_timeout(
        start_coordinator, how):
    coordinator = await start_coordinator(heartbeat_timeout=HEARTBEAT)
    procs = await spawn_ranks("allreduce_until_error", coordinator.address, 3, "direct-kill",
                              TINY)
    await survivors_of_a_lost_rank(procs, 1, how)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
async def test_a_lost_coordinator_gives_small_collectives_a_named_error_quickly(how):
    """Killed: the stream breaks and the session names the hub. Frozen: nothing breaks; the
    session notices the silence on its control connection and the lane's watch ends the
    collectives in flight with that error."""
    await ranks_named_a_lost_coordinator(how, TINY, within=SOON)
