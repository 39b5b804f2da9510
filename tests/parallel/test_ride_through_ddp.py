"""A coordinator killed (SIGKILL) in the middle of a Synchronous DDP job (and of an FSDP one)
and started again on the same port: no rank process exits or raises, each rides through once
(client/reconnect.py), and every rank's final parameters are bitwise those of the others and,
within float32 rounding, those of one process trained on every rank's batches — what an
undisturbed run ends with. Three real ranks of ``ride_through_script.py``; the coordinator a
process of its own (``gradstar coordinator``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.integration.conftest import spawn_coordinator

from .conftest import finish, kill_all, rank_env, rank_lines

#: Three or four torch processes, a coordinator started twice, and a reference trained here.
pytestmark = pytest.mark.timeout(300)

SCRIPT = Path(__file__).with_name("ride_through_script.py")
WORLD, STEPS, PAUSE = 3, 14, 0.05
#: The step after which the coordinator is killed, and how long it stays away.
KILL_AFTER, AWAY = 4, 1.0


async def ride_through_a_kill(*mode: str, world: int = WORLD, flags: tuple[str, ...] = (),
                             kill: bool = True) -> tuple[list[list[dict]], list[str]]:
    """The run of ``world`` ranks (``mode``: the script's wrapper, DDP by default) on a
    coordinator started with ``flags`` and killed after step KILL_AFTER (unless not ``kill``):
    each rank's JSON lines and its stderr."""
    hub, address = await spawn_coordinator(*flags)
    port = address.rsplit(":", 1)[1]
    procs = []
    try:
        for rank in range(world):
            procs.append(await asyncio.create_subprocess_exec(
                sys.executable, str(SCRIPT), str(STEPS), str(PAUSE), *mode,
                env=rank_env(address, "ride-ddp", world, rank, GRADSTAR_RECONNECT_TIMEOUT=60),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE))
        for _ in range(KILL_AFTER + 1):
            line = await asyncio.wait_for(procs[0].stdout.readline(), 90)
            assert line.startswith(b"step"), line
        if kill:
            hub.kill()
            await hub.wait()
            await asyncio.sleep(AWAY)
            hub, again = await spawn_coordinator(*flags, "--port", port)
            assert again == address
        results = await asyncio.gather(*(finish(p, 120) for p in procs),
                                       return_exceptions=True)
    finally:
        await kill_all(procs)
        with contextlib.suppress(ProcessLookupError):
            hub.kill()
        await hub.wait()
    lines = [rank_lines(rank, result) for rank, result in enumerate(results)]
    return lines, [result[2] for result in results]


async def reference(steps: int = STEPS) -> list[np.ndarray]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(SCRIPT), "reference", str(steps), str(WORLD),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    code, out, err = await finish(proc, 60)
    assert code == 0, err[-2000:]
    return [np.array(p, np.float32) for p in json.loads(out.splitlines()[-1])["params"]]


def rode_through_once(lines: list[list[dict]], stderrs: list[str], times: int = 1) -> None:
    """One restart (or ``times``), as many rides through and log lines per rank, and no
    traceback: nothing raised."""
    for report, err in zip(lines, stderrs, strict=True):
        assert len(report[-1]["reconnects"]) == times, report[-1]["reconnects"]
        assert err.count("rejoined the coordinator at") == times, err[-3000:]
        assert "Traceback" not in err, err[-3000:]


def ended_as_the_reference(lines: list[list[dict]], steps: int = STEPS) -> None:
    """Every rank's final parameters bitwise alike, and within float32 rounding those of one
    process trained on every rank's batches for ``steps`` steps."""
    finals = [[np.array(p, np.float32) for p in rank[-1]["params"]] for rank in lines]
    for rank in range(WORLD):
        assert all(np.array_equal(a, b) for a, b in zip(finals[0], finals[rank], strict=True))
    expected = asyncio.run(reference(steps))
    for got, want in zip(finals[0], expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", [(), ("fsdp",)], ids=["ddp", "fsdp"])
def test_training_rides_through_a_coordinator_killed_mid_training(mode):
    lines, stderrs = asyncio.run(ride_through_a_kill(*mode))
    rode_through_once(lines, stderrs)
    ended_as_the_reference(lines)


def test_ddp_on_a_sharded_hub_rides_through_a_coordinator_killed_mid_training():
    """``--shards 2``: the killed coordinator's shard processes end with it, and the restarted
    one starts its own; the rebuilt generation stripes over those (other ports), and the
    collectives issued again go there."""
    lines, stderrs = asyncio.run(ride_through_a_kill(flags=("--shards", "2")))
    rode_through_once(lines, stderrs)
    ended_as_the_reference(lines)
    for report in lines:
        before, after = report[-1]["shards"]
        assert len(before) == 2, before  # striped over the shards, not the hub alone
        assert len(after) == 2 and not set(before) & set(after), (before, after)


def test_a_pipeline_rides_through_a_coordinator_killed_mid_training():
    from . import pipeline_script

    lines, stderrs = asyncio.run(ride_through_a_kill("pipeline", world=pipeline_script.STAGES))
    rode_through_once(lines, stderrs)
    model, _ = pipeline_script.train_reference([32] * STEPS)
    for rank, report in enumerate(lines):
        want = pipeline_script.params_of(model[rank])
        got = report[-1]["params"]
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_diloco_rides_through_a_coordinator_killed_mid_training(tmp_path):
    """Its outer rounds (gradstar.LocalSGD with Nesterov) on a coordinator restarted with the
    same --state-dir end where an undisturbed run of the same job ends."""
    runs = {}
    for kill in (False, True):
        flags = ("--state-dir", str(tmp_path / f"state-{kill}"))
        runs[kill] = asyncio.run(ride_through_a_kill("diloco", flags=flags, kill=kill))
    rode_through_once(*runs[True])
    undisturbed = [np.array(p, np.float32) for p in runs[False][0][0][-1]["params"]]
    for rank in runs[True][0]:
        for got, want in zip(rank[-1]["params"], undisturbed, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert all(len(rank[-1]["reconnects"]) == 0 for rank in runs[False][0])
