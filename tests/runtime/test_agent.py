"""``gradstar worker``: a killed rank is restarted, the survivor re-joins the next generation,
both resume from the hub's global model, and the job completes with no round lost."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys

from .conftest import GRADSTAR, Lines, clean_env, http_get, stop_process

EPOCHS, SAMPLES = 6, 4000  # about 3200 training rows / global batch 128: 24 steps per epoch


async def test_agent_restarts_a_killed_rank_and_the_job_completes(start_coordinator):
    hub = await start_coordinator()
    proc = await asyncio.create_subprocess_exec(
        *GRADSTAR, "worker", "--coordinator", hub.address, "--job", "elastic", "--nproc", "2",
        "--max-restarts", "1", "--health-port", "0", "--health-host", "127.0.0.1", "--",
        sys.executable, "-m", "gradstar.worker.demo.train", "--mode", "localsgd", "--sync-every",
        "1", "--epochs", str(EPOCHS), "--samples", str(SAMPLES), "--timeout", "60",
        env=clean_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = Lines(proc.stdout), Lines(proc.stderr)
    try:
        port = int((await err.wait_for(r"health on http://127\.0\.0\.1:(\d+)/healthz", 30))[1])
        steps = int((await out.wait_for(rf"{EPOCHS} epochs of (\d+) steps", 60))[1])
        status, kind, body = await http_get(port, "/healthz")
        health = json.loads(body)
        assert (status, kind) == (200, "application/json")
        assert health["state"] == "running" and health["healthy"] is True
        assert health["coordinator_health"] == "SERVING"
        assert [r["state"] for r in health["ranks"]] == ["running", "running"]
        victim = health["ranks"][1]["pid"]

        # Mid-run: rank 1 cannot be more than one averaging round ahead of rank 0's line.
        await out.wait_for(r"^\[rank 0\] rank 0: epoch 1/", 60)
        os.kill(victim, signal.SIGKILL)
        code = await asyncio.wait_for(proc.wait(), 90)
        await out.finish()
        await err.finish()
    finally:
        await stop_process(proc)

    stdout, stderr = out.text, err.text
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    assert (f"gradstar worker: rank 1 (pid {victim}) was killed by signal 9 (SIGKILL); "
            "restarting it (restart 1 of 1)") in stderr
    assert re.search(r"gradstar worker: started rank 1 \(pid \d+\), restart 1", stderr)
    assert "gradstar worker: all 2 ranks succeeded" in stderr
    # The survivor saw the loss, re-joined, and both resumed where the hub's model was.
    assert re.search(r"\[rank 0\] gradstar\.worker\.demo\.train: generation lost "
                     r"\(RankLostError", stderr)
    total = EPOCHS * steps
    resumed = re.search(r"\[rank 0\] rank 0: generation 2, 2 ranks, resuming at step (\d+) of "
                        rf"{total}", stdout)
    assert resumed and steps <= int(resumed[1]) < total, stdout[-3000:]
    job = hub.rendezvous.jobs["elastic"]
    assert job.generations_formed == 2
    # One round per step, each counted once: the rounds before the loss plus those after it.
    (model,) = hub.averaging.models("elastic").values()
    assert model.rounds == total
