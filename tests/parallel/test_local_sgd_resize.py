"""DiLoCo in a job that grows and shrinks while it trains (real rank processes, a real
coordinator): 3 ranks, a fourth process joins past the world size, then one of the first
leaves for good; nobody restarts. The ranks cross a step boundary after each round, where the
newcomer receives the global model and the schedule from rank 0, and where the leaver leaves.
The ranks that stay end bitwise equal to each other and equal to one process replaying the
rounds: each round, every rank that took part trained from the global model on its own data,
and the outer Nesterov step took the mean of their pseudo-gradients."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import numpy as np
import torch

from gradstar.coordinator.rendezvous.resize import Resize
from tests.integration.conftest import finish, rank_env, until

from . import local_sgd_script as script

SCRIPT = Path(script.__file__)
SYNC_EVERY, STEPS, WAIT_AT, LEAVER, LR, MU = 2, 20, 6, 1, 0.7, 0.9


def replay(rounds: dict[int, set[int]]) -> np.ndarray:
    """The global model after every round, in one process: round r's mean over the processes
    that took part in it (``rounds``: process -> its rounds)."""
    global_params = script.flat(script.make_model(100))
    momentum = np.zeros_like(global_params)
    for r in range(1, max(max(done, default=0) for done in rounds.values()) + 1):
        sent = []
        for ident in sorted(i for i, done in rounds.items() if r in done):
            model = script.make_model(0)
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(torch.from_numpy(global_params.copy()),
                                                    model.parameters())
            opt = script.make_optimizer(model, "sgd")
            for step in range((r - 1) * SYNC_EVERY, r * SYNC_EVERY):
                script.ident_step(model, opt, step, ident)
            sent.append(global_params - script.flat(model))
        delta = np.mean(sent, axis=0)
        momentum = MU * momentum + delta
        global_params = global_params - LR * (delta + MU * momentum)
    return global_params


async def test_diloco_grows_and_shrinks_at_round_boundaries(start_coordinator, tmp_path):
    hub = await start_coordinator()
    go = tmp_path / "go"
    common = ["elastic", str(tmp_path), "--sync-every", str(SYNC_EVERY), "--steps", str(STEPS),
              "--wait-at", str(WAIT_AT), "--go", str(go), "--leaver", str(LEAVER)]
    limits = dict(GRADSTAR_MAX_WORLD_SIZE=4, GRADSTAR_MIN_WORLD_SIZE=2)

    async def spawn(ident: int, **env):
        return await asyncio.create_subprocess_exec(
            sys.executable, str(SCRIPT), *common, "--ident", str(ident), env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)

    procs = [await spawn(r, **rank_env(hub.address, "grow", 3, r, **limits)) for r in range(3)]
    try:
        # The joiner starts once the first ranks wait at their step WAIT_AT: it comes in at the
        # boundary after their next round, wherever a loaded machine has them meanwhile.
        await until(lambda: all((tmp_path / f"waiting{r}").exists() for r in range(3)),
                    "the first ranks reached their step WAIT_AT", 120)
        env = rank_env(hub.address, "grow", 3, 0, GRADSTAR_ELASTIC=1, **limits)
        del env["GRADSTAR_RANK"]
        procs.append(await spawn(3, **env))
        # The joiner waits at the hub for the boundary; then the first ranks go on to it.
        await until(lambda: isinstance(r := hub.rendezvous.jobs["grow"].resize, Resize)
                    and r.joiners, "the joiner waited for a boundary", 120)
        go.touch()
        results = await asyncio.gather(*(finish(p, 120) for p in procs))
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
    lines = {}
    for ident, (code, out, err) in enumerate(results):
        assert code == 0, out + err[-3000:]
        lines[ident] = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert_resized(lines, tmp_path)


def assert_resized(lines: dict[int, list[dict]], out: Path) -> None:
    """The checks of a DiLoCo job grown by process 3 and shrunk by process LEAVER, from every
    process's printed lines and the finals the ones that stayed saved in ``out``."""
    rounds = {i: {line["round"] for line in printed if "round" in line}
              for i, printed in lines.items()}
    worlds = [line["world"] for line in lines[0] if "round" in line]
    assert worlds[0] == 3 and 4 in worlds and worlds[-1] == 3, worlds
    joined = next(line for line in lines[3] if "joined" in line)
    # The newcomer took up the schedule where the others were, from the global model.
    assert joined["joined"] == WAIT_AT // SYNC_EVERY + 1
    assert joined["steps"] == joined["joined"] * SYNC_EVERY
    assert min(rounds[3]) == joined["joined"] + 1
    assert lines[LEAVER][-1]["left"] and max(rounds[LEAVER]) < STEPS // SYNC_EVERY
    assert max(rounds[LEAVER]) >= min(rounds[3])  # it left after the newcomer came
    assert rounds[0] == rounds[2] == set(range(1, STEPS // SYNC_EVERY + 1))
    finals = {i: np.load(out / f"final{i}.npy") for i in (0, 2, 3)}
    np.testing.assert_array_equal(finals[0], finals[2])
    np.testing.assert_array_equal(finals[0], finals[3])
    np.testing.assert_allclose(finals[0], replay(rounds), rtol=1e-5, atol=1e-6)
    # The newcomer's pseudo-gradients were in the mean: without them the rounds end elsewhere.
    assert not np.allclose(finals[0], replay({i: d for i, d in rounds.items() if i != 3}),
                           rtol=1e-4, atol=1e-5)
