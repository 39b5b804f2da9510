"""``gradstar admin`` against a live coordinator with a job whose collective is in flight."""

from __future__ import annotations

import asyncio
import json
import re

import numpy as np

from tests.integration.conftest import close_all, join_all

from .conftest import clean_env, run_gradstar


async def test_status_shows_members_and_the_ranks_a_collective_waits_for(start_coordinator):
    hub = await start_coordinator()
    groups = await join_all(hub.address, 3, job="train")
    pending = []
    try:
        # One completed collective for the counters, then one that rank 2 has not reached.
        await asyncio.gather(*(g.all_reduce(np.ones(1000, np.float32)) for g in groups))
        pending = [asyncio.ensure_future(g.all_reduce(np.ones(1000, np.float32)))
                   for g in groups[:2]]
        job = hub.rendezvous.jobs["train"]
        for _ in range(200):  # both headers and chunks reach the hub within a few loop turns
            if job.counters.bytes_in == 5 * 4000 and any(
                    len(c.participants) == 2 for c in job.generation.collectives.values()):
                break
            await asyncio.sleep(0.05)

        code, out, err = await run_gradstar("admin", "status", "--coordinator", hub.address,
                                            "--interval", "0.2", timeout=30)
        assert code == 0, err
        assert out.startswith(f"coordinator {hub.address}: SERVING, 1 job\n")
        assert "job train: running, generation 1, 3/3 members" in out
        assert "collectives  all_reduce 1" in out
        assert "throughput" in out and "collectives/s" in out
        assert re.search(r"RANK\s+PEER\s+HEARTBEAT AGE", out)
        assert re.search(r"SEQ\s+GROUP\s+OP\s+AGE\s+ARRIVED\s+WAITING FOR", out)
        assert re.search(r"\n\s+2\s+default\s+all_reduce\s+[\d.]+ s\s+0,1\s+2\n", out + "\n"), out

        code, out, err = await run_gradstar("admin", "status", "--coordinator", hub.address,
                                            "--job", "train", "--json", "--interval", "0",
                                            timeout=30)
        assert code == 0, err
        status = json.loads(out)
        (job,) = status["jobs"]
        assert status["health"] == "SERVING"
        assert (job["job"], job["state"], job["generation"], job["members"]) == ("train",
                                                                                 "running", 1, 3)
        assert [m["rank"] for m in job["live_members"]] == [0, 1, 2]
        (flight,) = job["in_flight"]
        assert (flight["op"], flight["arrived_ranks"], flight["missing_ranks"]) == (
            "all_reduce", [0, 1], [2])
        assert job["collectives"]["all_reduce"] == {"completed": 1, "failed": 0}
        assert job["bytes_in"] == 3 * 4000 + 2 * 4000  # the completed one, and two arrivals

        code, out, _ = await run_gradstar("admin", "jobs", "--coordinator", hub.address,
                                          timeout=30)
        assert code == 0
        assert re.search(r"JOB\s+STATE\s+GENERATION\s+MEMBERS\ntrain\s+running\s+1\s+3/3", out)

        # Rank 2 arrives: the collective completes and leaves the in-flight table.
        await asyncio.wait_for(asyncio.gather(groups[2].all_reduce(np.ones(1000, np.float32)),
                                              *pending), 20)
        code, out, _ = await run_gradstar("admin", "status", "--coordinator", hub.address,
                                          "--interval", "0", timeout=30)
        assert "in flight    none" in out and "collectives  all_reduce 2" in out
    finally:
        for task in pending:
            task.cancel()
        await close_all(groups)


async def test_stragglers_table_and_json_name_the_late_rank(start_coordinator):
    # Tokens apart: the admin command uses the admin token, a rank its job token.
    hub = await start_coordinator(token="job-secret", admin_token="admin-secret")
    groups = await join_all(hub.address, 3, job="late", token="job-secret")
    late, rounds = 0.1, 6
    try:
        async def step(g):
            if g.rank == 1:
                await asyncio.sleep(late)
            await g.all_reduce(np.ones(100, np.float32))

        for _ in range(rounds):
            await asyncio.gather(*(step(g) for g in groups))
        # A rank reads the same with its job token.
        seen = await groups[0].straggler_stats(limit=1)
        assert [r.rank for r in seen.ranks] == [1] and seen.ranks_total == 3
        assert [r.rank for r in seen.stragglers] == [1]
    finally:
        await close_all(groups)

    admin = ("--coordinator", hub.address, "--admin-token", "admin-secret")
    code, out, err = await run_gradstar("admin", "stragglers", "--job", "late", *admin,
                                        timeout=30)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "job late: 3 rank(s) measured; straggler(s): rank 1"
    assert re.match(r"\s+RANK\s+HOST\s+MEDIAN LAG\s+P95 LAG\s+RECENT LAG\s+LAST\s+"
                    r"OTHERS WAITED\s+COLLECTIVES", lines[1]), out
    first = lines[2].split()
    assert first[0] == "1" and first[-1] == "straggler" and "100%" in first, out
    assert [line.split()[0] for line in lines[2:]] == ["1", "0", "2"] or \
        [line.split()[0] for line in lines[2:]] == ["1", "2", "0"]
    assert "straggler" not in "".join(lines[3:])

    code, out, err = await run_gradstar("admin", "stragglers", "--job", "late", "--json",
                                        *admin, timeout=30)
    assert code == 0, err
    data = json.loads(out)
    assert data["job"] == "late" and data["ranks_total"] == 3
    slow, *others = data["ranks"]
    assert (slow["rank"], slow["flagged"], slow["collectives"]) == (1, True, rounds)
    assert late * 0.7 <= slow["median_lag_seconds"] <= late + 0.15
    assert slow["last_share"] == 1.0 and slow["host"]
    assert all(not r["flagged"] and r["median_lag_seconds"] < late / 2 for r in others)
    assert set(slow) >= {"rank", "host", "median_lag_seconds", "p95_lag_seconds",
                         "ewma_lag_seconds", "last_share", "waited_seconds"}

    code, _, err = await run_gradstar("admin", "stragglers", *admin, timeout=30)
    assert code == 2 and "--job" in err
    code, _, err = await run_gradstar("admin", "stragglers", "--job", "nope", *admin,
                                      timeout=30)
    assert code == 1 and "no job named 'nope'" in err


async def test_health_and_drain(start_coordinator):
    hub = await start_coordinator()
    code, out, _ = await run_gradstar("admin", "health", "--coordinator", hub.address, timeout=30)
    assert (code, out.strip()) == (0, "SERVING")

    code, out, _ = await run_gradstar("admin", "drain", "--coordinator", hub.address, "--json",
                                      timeout=30)
    assert code == 0
    assert json.loads(out) == {"coordinator": hub.address, "draining": True, "active_jobs": 0}

    code, out, _ = await run_gradstar("admin", "health", "--coordinator", hub.address, timeout=30)
    assert (code, out.strip()) == (1, "NOT_SERVING")


async def test_admin_token_is_required_and_accepted(start_coordinator, tmp_path):
    hub = await start_coordinator(token="job-secret", admin_token="admin-secret")
    code, _, err = await run_gradstar("admin", "jobs", "--coordinator", hub.address, timeout=30)
    assert code == 1
    assert "refused listing jobs" in err and "admin token missing" in err
    assert "admin-secret" not in err

    code, out, err = await run_gradstar("admin", "jobs", "--coordinator", hub.address,
                                        "--admin-token", "admin-secret", timeout=30)
    assert (code, out.strip()) == (0, "no jobs"), err

    # A docker secret: the token read from the file GRADSTAR_ADMIN_TOKEN_FILE names.
    secret = tmp_path / "admin_token"
    secret.write_text("admin-secret\n")
    code, out, err = await run_gradstar("admin", "jobs", "--coordinator", hub.address,
                                        timeout=30,
                                        env=clean_env(GRADSTAR_ADMIN_TOKEN_FILE=str(secret)))
    assert (code, out.strip()) == (0, "no jobs"), err


async def test_an_unreachable_coordinator_is_a_clear_error(start_coordinator):
    hub = await start_coordinator()
    address = hub.address
    await hub.stop(grace=0)
    code, _, err = await run_gradstar("admin", "status", "--coordinator", address,
                                      "--timeout", "2", timeout=30)
    assert code == 1
    assert f"gradstar admin: could not reach the coordinator at {address}" in err
