"""A Synchronous DDP job that grows and shrinks while it trains, with real rank processes and a
real coordinator: 3 ranks start (max 4, min 2), a fourth joins past the world size, then one of
the first leaves for good; no process restarts. Every rank that stays ends with bitwise the same
parameters, and they equal one process replaying the run: at each step the mean gradient over
the batches of the ranks that ran it, with the momentum the optimizer carried across both
resizes (the newcomer's came in the snapshot)."""

from __future__ import annotations

import asyncio
import sys

import torch
from torch import nn

from gradstar.config import CoordinatorSettings
from gradstar.coordinator import Coordinator
from tests.integration.conftest import until

from . import resize_script as script
from .conftest import finish, kill_all, rank_env, rank_lines

FIRST = 3


def replay(steps: dict[int, list[int]]) -> list[torch.Tensor]:
    """One process: the mean gradient over each step's batches, SGD with momentum."""
    model = script.make_model(100)  # rank 0's model: the first broadcast's
    opt = torch.optim.SGD(model.parameters(), lr=script.LR, momentum=script.MOMENTUM)
    for step in sorted(steps):
        opt.zero_grad()
        idents = steps[step]
        for ident in idents:
            x, y = script.batch(step, ident)
            loss = nn.functional.mse_loss(model(x), y) / len(idents)
            loss.backward()
        opt.step()
    return [p.detach().reshape(-1) for p in model.parameters()]


async def run(first: int, flags: dict[int, list[str]], joiner: list[str],
              joiner_code: int = 0) -> list[list[dict]]:
    """``first`` ranks (with ``flags`` by ident), then a joiner (ident ``first``) once the job
    formed; each process's JSON lines, by ident (the joiner must exit with ``joiner_code``)."""
    hub = Coordinator(CoordinatorSettings(host="127.0.0.1", port=0))
    await hub.start()
    procs = []

    def start(ident: int, *args: str):
        env = rank_env(hub.address, "resize", first, ident, GRADSTAR_MAX_WORLD_SIZE="4",
                       GRADSTAR_MIN_WORLD_SIZE="2", GRADSTAR_TIMEOUT="60")
        if "--joiner" in args:
            del env["GRADSTAR_RANK"]
            env["GRADSTAR_ELASTIC"] = "1"
        return asyncio.create_subprocess_exec(
            sys.executable, str(script.SCRIPT), str(ident), *args, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)

    try:
        for ident in range(first):
            procs.append(await start(ident, *flags.get(ident, [])))
        await until(lambda: getattr(hub.rendezvous.jobs.get("resize"), "generation", None),
                    "the job's first generation formed", 60)
        procs.append(await start(first, "--joiner", *joiner))
        results = await asyncio.gather(*(finish(p, 150) for p in procs),
                                       return_exceptions=True)
    finally:
        await kill_all(procs)
        await hub.stop(grace=0)
    code, out, err = results[-1]
    assert code == joiner_code, f"the joiner exited with {code}:\n{out[-2000:]}\n{err[-3000:]}"
    results[-1] = (0, out, err)
    return [rank_lines(ident, result) for ident, result in enumerate(results)]


def steps_run(lines: list[list[dict]]) -> dict[int, list[int]]:
    """Which processes (idents) ran each step."""
    steps: dict[int, list[int]] = {}
    for printed in lines:
        for line in printed:
            if "step" in line:
                steps.setdefault(line["step"], []).append(line["ident"])
    assert sorted(steps) == list(range(len(steps)))  # no step skipped, none run twice
    return steps


def assert_replayed(finals: list[dict], steps: dict[int, list[int]]) -> None:
    """Every final equal, bitwise, and equal to the one-process replay of ``steps``."""
    assert all(f["params"] == finals[0]["params"] for f in finals)
    for got, want in zip(finals[0]["params"], replay(steps), strict=True):
        torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)


async def test_a_synchronous_job_grows_and_shrinks_without_a_restart():
    lines = await run(FIRST, {1: ["--leaver"]}, [])

    resizes = {ident: [line for line in printed if "resize" in line]
               for ident, printed in enumerate(lines)}
    grown, shrunk = resizes[0]  # the first ranks saw both
    assert (grown["world"], shrunk["world"]) == (4, 3)
    assert grown["newcomers"] == [3] and shrunk["newcomers"] == []
    assert [r["resize"] for r in resizes[3]] == [shrunk["resize"]]  # the joiner saw the second
    assert [r["resize"] for r in resizes[1]] == [grown["resize"]]  # the leaver saw the first
    assert any("left_at" in line and line["left_at"] == shrunk["resize"] for line in lines[1])
    # The ranks after the leaver moved up one: ident 2 was rank 2, then rank 1.
    assert [r["rank"] for r in resizes[2]] == [2, 1]

    steps = steps_run(lines)
    # (The joiner may come before the first step: then nothing ran before it.)
    assert {len(steps[s]) for s in range(grown["resize"])} <= {3}
    assert {len(steps[s]) for s in range(grown["resize"], shrunk["resize"])} == {4}
    assert {len(steps[s]) for s in range(shrunk["resize"], len(steps))} == {3}

    assert_replayed([next(line for line in printed if "params" in line)
                     for ident, printed in enumerate(lines) if ident != 1], steps)


async def test_a_joiner_with_another_model_leaves_and_the_others_go_on():
    lines = await run(2, {0: ["--resizes", "1"], 1: ["--resizes", "1"]}, ["--other-model"],
                      joiner_code=3)
    refused = [line["refused"] for line in lines[2] if "refused" in line]
    assert refused and "module['0.weight'] is float32 [12, 5]" in refused[0], lines[2]
    back = [line for line in lines[0] if "resize" in line]
    assert [(r["world"], r["newcomers"]) for r in back] == [(2, [])]  # back to the two
    steps = steps_run(lines)
    assert {len(idents) for idents in steps.values()} == {2}  # the joiner ran no step
    assert_replayed([next(line for line in printed if "params" in line)
                     for printed in lines[:2]], steps)
