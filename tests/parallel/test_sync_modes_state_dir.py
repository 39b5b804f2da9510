"""A sync-mode job's snapshot in ``--state-dir`` survives a coordinator restart: the file holds
exactly the state a rank had at that step, and the ranks of the restarted job resume from it
(not from rank 0's fresh parameters), bitwise identical to each other."""

from __future__ import annotations

import asyncio
import sys

import torch

from gradstar.client.steps.snapshot import unpack
from gradstar.config import CoordinatorSettings
from gradstar.coordinator import Coordinator
from gradstar.coordinator.steps import SnapshotStore

from . import sync_modes_script as script
from .conftest import finish, kill_all, rank_env, rank_lines

WORLD = 2
JOB = "statedir"


async def run_job(state_dir, steps: int) -> list[list[dict]]:
    """A coordinator with ``state_dir`` and WORLD ranks of the script in Quorum (every rank),
    each printing its state at the start and after every step; their JSON lines by rank."""
    hub = Coordinator(CoordinatorSettings(host="127.0.0.1", port=0, heartbeat_timeout=8.0,
                                          state_dir=state_dir))
    await hub.start()
    procs = []
    try:
        for rank in range(WORLD):
            procs.append(await asyncio.create_subprocess_exec(
                sys.executable, str(script.SCRIPT), "quorum", "--min-ranks", str(WORLD),
                "--steps", str(steps), "--print-states",
                env=rank_env(hub.address, JOB, WORLD, rank),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE))
        results = await asyncio.gather(*(finish(p, 120) for p in procs),
                                       return_exceptions=True)
    finally:
        await kill_all(procs)
        await hub.stop(grace=0)
    return [rank_lines(rank, result) for rank, result in enumerate(results)]


def test_the_snapshot_in_the_state_dir_survives_a_coordinator_restart(tmp_path):
    first = asyncio.run(run_job(tmp_path, 20))
    states = {line["state"]["step"]: line["state"] for line in first[0] if "state" in line}
    assert sorted(states) == list(range(1, 21))

    # The file: exactly rank 0's module and optimizer state after the step it names. The hub
    # asks for one at its first steps and again SNAPSHOT_EVERY = 16 steps later; which of the
    # two is in the file depends on timing (the first upload still going at step 17 puts the
    # second after it, maybe past the end of the job; on this machine the 16 steps take ~50 ms
    # and the hub fsyncs each snapshot), so any step of the job.
    saved = SnapshotStore(tmp_path).load(JOB, "ddp")
    assert saved is not None, "no snapshot was written to the state directory"
    assert 1 <= saved.steps <= 20
    model = script.make_mlp()
    opt = script.make_optimizer(model)
    unpack(saved.layout, saved.data, model, opt)
    assert script.params_of(model) == states[saved.steps]["params"]
    momentum = [opt.state[p]["momentum_buffer"].reshape(-1).tolist() for p in model.parameters()]
    assert momentum == states[saved.steps]["momentum"]

    # A new coordinator on the same folder, and the job's ranks started again: they begin at
    # the saved step with the saved state, not from make_mlp()'s parameters.
    second = asyncio.run(run_job(tmp_path, 5))
    fresh = script.params_of(script.make_mlp())
    for rank, lines in enumerate(second):
        start = next(line["start"] for line in lines if "start" in line)
        assert start["step"] == saved.steps, f"rank {rank} did not resume from the snapshot"
        assert start["params"] == states[saved.steps]["params"]
        assert start["momentum"] == states[saved.steps]["momentum"]
        assert start["params"] != fresh
    finals = [next(line for line in lines if "params" in line and "rank" in line
                   and "steps" in line) for lines in second]
    assert finals[0]["params"] == finals[1]["params"]
    assert [s["step"] for s in finals[0]["steps"]] == list(range(saved.steps + 1,
                                                               saved.steps + 6))
    assert not torch.equal(torch.tensor(finals[0]["params"]["0.weight"]),
                           torch.tensor(states[saved.steps]["params"]["0.weight"]))
