"""Sync-mode DDP (Quorum, BoundedStaleness, Asynchronous) across a coordinator killed
(SIGKILL) mid-training and started again on the same port (and across a standby's takeover
under ``--ha``): no rank process exits or raises, each rides through (client/steps/riding.py),
the ledger resumes at the highest step count a rank applied (coordinator/steps/resume.py), and
every rank's final parameters are bitwise those of the others and those of a one-process
replay of the hub's record (which contribution joined which step), the sync-mode tests'
replay. Real rank processes of ``sync_modes_script.py``; the coordinator a process of its own
(``gradstar coordinator``)."""

from __future__ import annotations

import asyncio
import signal
import sys

import numpy as np
import pytest

from tests.integration.conftest import etcd_server, next_line, spawn_coordinator, spawn_standby

from . import sync_modes_script as script
from .conftest import finish, kill_all, kill_coordinators, rank_env, rank_lines
from .test_standby_ddp import until_rebuilt

pytestmark = pytest.mark.timeout(300)

WORLD, STEPS = 3, 16
#: Contributions rank 0 makes before the coordinator is killed, and how long it stays away.
KILL_AFTER, AWAY = 5, 1.0
#: Seconds each rank sleeps before each backward: rank 2 is the slow one, whose gradients
#: Quorum(min_ranks=2) often leaves out.
DELAYS = "0.05,0.05,0.25"


async def train_across_kills(mode: tuple[str, ...], kills: int = 1, ha: str | None = None,
                             tmp_path=None) -> dict[int, list[dict]]:
    """WORLD ranks of the script in ``mode``, on a coordinator killed ``kills`` times, each
    after rank 0's next KILL_AFTER contributions: restarted on its port, or (``ha``: an etcd
    URL) two coordinators under --ha whose leader is killed and started again as the standby.
    Each rank's JSON lines by rank."""
    if ha is None:
        hub, address = await spawn_coordinator()
        hubs, addresses = [(hub, address, "leader")], [address]
    else:
        flags = ("--ha-ttl", "2", "--state-dir", str(tmp_path / "state"))
        hubs = [await spawn_standby(ha, *flags) for _ in range(2)]
        assert [role for _, _, role in hubs] == ["leader", "standby"]
        addresses = [a for _, a, _ in hubs]
    procs, consumed = [], []
    try:
        for rank in range(WORLD):
            procs.append(await asyncio.create_subprocess_exec(
                sys.executable, str(script.SCRIPT), *mode, "--steps", str(STEPS),
                "--delays", DELAYS,
                env=rank_env(",".join(addresses), "ride-modes", WORLD, rank,
                             GRADSTAR_RECONNECT_TIMEOUT=60),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE))
        for k in range(kills):
            seen = 0
            while seen < KILL_AFTER:  # rank 0's contributions since the last kill
                line = await asyncio.wait_for(procs[0].stdout.readline(), 90)
                assert line, "rank 0 exited before the coordinator was killed"
                consumed.append(line.decode())
                seen += b'"contribution"' in line
            leader = k % len(hubs)
            hubs[leader][0].send_signal(signal.SIGKILL)
            await hubs[leader][0].wait()
            port = addresses[leader].rsplit(":", 1)[1]
            if ha is None:
                await asyncio.sleep(AWAY)
                hub, again = await spawn_coordinator("--port", port)
                assert again == addresses[0]
                hubs[0] = (hub, again, "leader")
                continue
            standby = (k + 1) % 2
            await asyncio.wait_for(next_line(hubs[standby][0],
                                             "gradstar coordinator listening on "), 30)
            hubs[leader] = await spawn_standby(ha, *flags, "--port", port)
            await until_rebuilt(addresses[standby])
        results = await asyncio.gather(*(finish(p, 150) for p in procs),
                                       return_exceptions=True)
        if not isinstance(results[0], BaseException):  # with the lines read above
            code, out, err = results[0]
            results[0] = (code, "".join(consumed) + out, err)
    finally:
        await kill_all(procs)
        await kill_coordinators(hubs)
    for rank, result in enumerate(results):
        if not isinstance(result, BaseException):
            err = result[2]
            assert "Traceback" not in err, f"rank {rank}:\n{err[-3000:]}"
            assert err.count("rejoined the coordinator at") == kills, err[-3000:]
    return {rank: rank_lines(rank, result) for rank, result in enumerate(results)}


def merged_record(finals: dict[int, dict]) -> list[dict]:
    """The hub's record of steps 1..N from every rank's applied steps: a rank behind the
    resumed ledger loaded a snapshot instead of some steps, so each rank's steps are a subset,
    and every rank that applied a step applied the same one."""
    steps: dict[int, dict] = {}
    for rank, final in finals.items():
        for entry in final["steps"]:
            known = steps.setdefault(entry["step"], entry)
            assert known == entry, f"rank {rank} applied another step {entry['step']}"
    assert sorted(steps) == list(range(1, len(steps) + 1)), sorted(steps)
    return [steps[n] for n in sorted(steps)]


def contributions_of(lines: dict[int, list[dict]], record: list[dict]) -> dict[int, list]:
    """Each rank's contributions (iteration, base, step joined), with the ones in flight when
    the coordinator went away put in the step that took them: a rank that had not heard its
    verdict counted it as dropped, yet some rank applied the step it joined."""
    contributions = {r: [dict(line["contribution"]) for line in printed if "contribution" in line]
                     for r, printed in lines.items()}
    for entry in record:
        for rank, staleness in zip(entry["ranks"], entry["staleness"], strict=True):
            mine = contributions[rank]
            if any(c["step"] == entry["step"] for c in mine):
                continue
            base = entry["step"] - 1 - staleness
            lost = [c for c in mine if c["step"] is None and c["base"] == base]
            assert lost, f"rank {rank}'s contribution to step {entry['step']} is unknown"
            lost[-1]["step"] = entry["step"]
    return contributions


def identical_and_replayed(lines: dict[int, list[dict]]) -> list[dict]:
    """Every rank the same parameters, bit for bit, equal to the one-process replay of the
    hub's record; the record."""
    finals = {r: next(line for line in printed if "params" in line)
              for r, printed in lines.items()}
    for rank, final in finals.items():
        assert final["params"] == finals[0]["params"], f"rank {rank} differs"
    record = merged_record(finals)
    replayed = script.params_of(script.replay(contributions_of(lines, record), record))
    for name, values in replayed.items():
        np.testing.assert_allclose(finals[0]["params"][name], values, rtol=1e-6, atol=1e-7,
                                   err_msg=name)
    return record


QUORUM = ("quorum", "--min-ranks", "2", "--timeout", "0.05")


@pytest.mark.parametrize("mode", [QUORUM, ("bounded",), ("async",)],
                         ids=["quorum", "bounded", "async"])
def test_a_sync_mode_job_rides_through_a_coordinator_killed_mid_training(mode):
    lines = asyncio.run(train_across_kills(mode))
    record = identical_and_replayed(lines)
    # Training went on after the restart: more steps than before it, and every rank applied
    # the last one.
    assert len(record) > KILL_AFTER
    for printed in lines.values():
        final = next(line for line in printed if "params" in line)
        assert final["steps"][-1]["step"] == len(record)


def test_a_quorum_job_trains_on_across_two_standby_takeovers(tmp_path):
    async def run():
        async with etcd_server(tmp_path) as etcd:
            return await train_across_kills(QUORUM, kills=2, ha=etcd, tmp_path=tmp_path)

    identical_and_replayed(asyncio.run(run()))
