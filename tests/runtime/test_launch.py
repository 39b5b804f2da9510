"""``gradstar launch``: real rank processes, an embedded or a given coordinator, failures named."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from .conftest import pid_alive, run_gradstar

SCRIPT = str(Path(__file__).with_name("rank_script.py"))


def rank_pids(stdout: str) -> dict[int, int]:
    return {int(r): int(p) for r, p in re.findall(r"^\[rank (\d+)\] pid (\d+)$", stdout, re.M)}


async def test_ranks_run_with_their_env_and_prefixed_output():
    code, out, err = await run_gradstar("launch", "--nproc", "3", "--job", "sums", SCRIPT, "sum",
                                        timeout=60)

    assert code == 0, out[-2000:] + err[-3000:]
    assert "coordinator 127.0.0.1:" in err and "(embedded)" in err
    assert "gradstar launch: all 3 ranks succeeded" in err
    reports = sorted((json.loads(line.partition("] ")[2]) for line in out.splitlines()
                      if line.startswith("[rank") and line.endswith("}")), key=lambda r: r["rank"])
    assert reports == [{"rank": r, "world": 3, "sum": 6.0, "local_rank": str(r), "job": "sums"}
                       for r in range(3)]
    # Output is prefixed line by line, even a line longer than the reader's buffer.
    assert "[rank 0] after the long line" in out.splitlines()
    assert sum(len(line) for line in out.splitlines() if set(line[9:]) == {"x"}) >= 3 << 19


@pytest.mark.parametrize(("scenario", "how", "exit_code"), [
    ("crash", "exited with code 7", 7),
    ("sigkill", "was killed by signal 9 (SIGKILL)", 128 + 9),
])
async def test_a_failing_rank_stops_the_others_and_is_named(scenario, how, exit_code):
    code, out, err = await run_gradstar("launch", "--nproc", "3", "--stop-grace", "5", SCRIPT,
                                        scenario, timeout=60)

    pids = rank_pids(out)
    assert code == exit_code, out[-2000:] + err[-3000:]
    assert re.search(rf"gradstar launch: rank 1 \(pid {pids[1]}\) {re.escape(how)}; stopped the "
                     r"other 2 rank\(s\)", err), err
    assert "[rank 1] rank 1 fails now" in err  # the rank's own stderr, prefixed, came first
    assert err.index("[rank 1] rank 1 fails now") < err.index(how)
    assert sorted(pids) == [0, 1, 2]
    assert not any(pid_alive(pid) for pid in pids.values())


async def test_launch_joins_a_given_coordinator(coordinator):
    code, _, err = await run_gradstar("launch", "--nproc", "2", "--coordinator",
                                        coordinator.address, "--job", "given", SCRIPT, "sum",
                                        timeout=60)

    assert code == 0, err[-3000:]
    assert f"coordinator {coordinator.address} (given)" in err
    job = coordinator.rendezvous.jobs["given"]
    assert job.world_size == 2 and job.generations_formed == 1


async def test_a_missing_script_is_a_named_failure(tmp_path):
    code, _, err = await run_gradstar("launch", "--nproc", "2", "--no-python",
                                      str(tmp_path / "nope"), timeout=30)

    assert code == 127
    assert "could not start" in err and "nope" in err
