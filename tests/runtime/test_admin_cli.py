"""``gradstar admin`` against a live coordinator with a job whose collective is in flight."""

from __future__ import annotations

import asyncio
import json
import re

import numpy as np

from tests.integration.conftest import close_all, join_all
from tests.integration.test_stragglers import FIELDS, as_rows, check_slow_first

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
        assert re.search(r"JOB\s+STATE\s+GENERATION\s+MEMBERS\s+SIZE\s+RESIZES\n"
                         r"train\s+running\s+1\s+3/3\s+fixed\s+0", out)

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
        # A rank reads it with its job token: the whole view, and its slowest row alone.
        full = await groups[0].straggler_stats()
        seen = await groups[0].straggler_stats(limit=1)
        assert seen.ranks_total == full.ranks_total == 3 and seen.ranks == full.ranks[:1]
        assert seen.stragglers == tuple(r for r in full.ranks[:1] if r.flagged)
    finally:
        await close_all(groups)

    admin = ("--coordinator", hub.address, "--admin-token", "admin-secret")
    code, out, err = await run_gradstar("admin", "stragglers", "--job", "late", *admin,
                                        timeout=30)
    assert code == 0, err
    lines = out.splitlines()
    code, out, err = await run_gradstar("admin", "stragglers", "--job", "late", "--json",
                                        *admin, timeout=30)
    assert code == 0, err
    data = json.loads(out)
    assert data["job"] == "late" and data["ranks_total"] == 3
    rows = data["ranks"]
    assert set(rows[0]) == set(FIELDS)
    # Each collective was measured as it matched, before the rank read the view: the rank and
    # the admin command see the very same figures.
    assert as_rows(rows) == as_rows(full.ranks)
    # What the scenario makes of them, whatever the machine's load (see
    # tests/integration/test_stragglers.py): consistent figures, flags as the rule says (rank 1
    # alone in a quiet run), rank 1 first, each collective counted once, a lag of at least
    # about the sleep, the others' below half its own (relative: load delays every rank), and
    # last in most rounds (another rank is last only where it stalls longer than the sleep).
    check_slow_first(rows, [1], 3, late * 0.7)
    slow = rows[0]
    assert slow["host"]
    assert all(r["collectives"] == rounds for r in rows)
    assert sum(r["last_arrivals"] for r in rows) == rounds
    assert slow["last_arrivals"] > rounds / 2
    # The table shows the same rows, in the same order, the flagged ones named in its head.
    flagged = [r["rank"] for r in rows if r["flagged"]]
    assert lines[0] == "job late: 3 rank(s) measured; " + (
        f"straggler(s): {', '.join(f'rank {r}' for r in flagged)}" if flagged
        else "no rank stands out")
    assert re.match(r"\s+RANK\s+HOST\s+MEDIAN LAG\s+P95 LAG\s+RECENT LAG\s+LAST\s+"
                    r"OTHERS WAITED\s+COLLECTIVES", lines[1]), out
    assert len(lines) == 2 + len(rows), out
    for line, r in zip(lines[2:], rows, strict=True):
        assert line.split() == [
            str(r["rank"]), r["host"] or "-", *_lag(r["median_lag_seconds"]),
            *_lag(r["p95_lag_seconds"]), *_lag(r["ewma_lag_seconds"]),
            f"{r['last_share'] * 100:.0f}%", *_lag(r["waited_seconds"]), str(r["collectives"]),
            *(["straggler"] if r["flagged"] else [])], (line, r)

    code, _, err = await run_gradstar("admin", "stragglers", *admin, timeout=30)
    assert code == 2 and "--job" in err
    code, _, err = await run_gradstar("admin", "stragglers", "--job", "nope", *admin,
                                      timeout=30)
    assert code == 1 and "no job named 'nope'" in err


def _lag(seconds: float) -> list[str]:
    """How the table shows a lag, as words."""
    return (f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s").split()


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
