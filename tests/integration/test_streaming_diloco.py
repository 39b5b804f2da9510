"""Streaming DiLoCo end to end: real replica processes, a real coordinator on 127.0.0.1:0.

- the rounds equal a single-process reference of the same algorithm (same fragments,
  schedule, tau, alpha and outer Nesterov);
- a replica SIGKILLed and one SIGSTOPped mid-training leave the others training, and the
  rounds completing without them, with no error;
- a replica started late catches up from the hub and ends with the others' global model;
- the global model and round counts survive a coordinator restart with --state-dir.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

from gradstar.client.outer import RoundsClient, Schedule, split_fragments
from gradstar.config import ClientSettings
from gradstar.coordinator.views import rounds_view
from tests.integration.conftest import until
from tests.runtime.conftest import http_get

SCRIPT = Path(__file__).with_name("replica_script.py")
_spec = importlib.util.spec_from_file_location("replica_script", SCRIPT)
replica_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(replica_script)

pytestmark = pytest.mark.timeout(240)


def _env(address: str, index: int, **sdl) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADSTAR_", "SDL_"))}
    env.update(GRADSTAR_COORDINATOR=address, GRADSTAR_JOB="sdl", SDL_INDEX=str(index),
               SDL_REPLICA=f"r{index}")
    env.update({f"SDL_{k.upper()}": str(v) for k, v in sdl.items()})
    return env


class Replica:
    """A replica process whose ``step N`` lines are read as they come."""

    def __init__(self, proc: asyncio.subprocess.Process, out: Path) -> None:
        self.proc, self.out, self.step, self.lines = proc, out, 0, []
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, tmp_path: Path, address: str, index: int, **sdl) -> Replica:
        out = tmp_path / f"r{index}.json"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(SCRIPT), str(out), env=_env(address, index, **sdl),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        return cls(proc, out)

    async def _read(self) -> None:
        async for line in self.proc.stdout:
            text = line.decode().strip()
            self.lines.append(text)
            if text.startswith("step "):
                self.step = int(text.split()[1])

    async def reach(self, step: int, timeout: float = 90) -> None:
        async with asyncio.timeout(timeout):
            while self.step < step:
                assert self.proc.returncode is None, await self.proc.stderr.read()
                await asyncio.sleep(0.02)

    async def result(self, timeout: float = 120) -> dict:
        async with asyncio.timeout(timeout):
            err = await self.proc.stderr.read()
            code = await self.proc.wait()
            await self._reader
        assert code == 0, err.decode()[-3000:]
        return json.loads(self.out.read_text())

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()


@pytest.fixture
async def replicas():
    started: list[Replica] = []
    yield started
    for r in started:
        if r.proc.returncode is None:
            r.proc.send_signal(signal.SIGCONT)
            r.kill()
            await asyncio.wait_for(r.proc.wait(), 10)


def reference(n: int, steps: int, H: int, P: int, tau: int, alpha: float,
              lr: float = 0.7, mu: float = 0.9):
    """The same algorithm in one process: n models, the hub's mean and outer Nesterov."""
    import torch

    models = [replica_script.make_model() for _ in range(n)]
    params = [list(m.parameters()) for m in models]
    runs = split_fragments([p.numel() for p in params[0]], P)
    sched = Schedule(H, P, tau)

    def flat(k, p):
        with torch.no_grad():
            return torch.cat([params[k][i].reshape(-1) for i in runs[p]]).numpy().copy()

    def load(k, p, values):
        offset = 0
        with torch.no_grad():
            for i in runs[p]:
                t = params[k][i]
                t.copy_(torch.from_numpy(values[offset:offset + t.numel()]).view_as(t))
                offset += t.numel()

    anchors = [flat(0, p) for p in range(P)]
    momentum: list = [None] * P
    pending: dict[int, tuple[int, np.ndarray]] = {}
    lr32, mu32 = np.float32(lr), np.float32(mu)

    def merge(p):
        _, g = pending.pop(p)
        for k in range(n):
            load(k, p, (alpha * flat(k, p) + (1.0 - alpha) * g).astype(np.float32))
        anchors[p] = g

    for step in range(1, steps + 1):
        for k in range(n):
            replica_script.inner_step(models[k], k, step - 1)
        for p in sched.starts(step):
            mean = anchors[p] - flat(0, p)
            for k in range(1, n):
                mean += anchors[p] - flat(k, p)
            mean /= np.float32(n)
            buf = mean.copy() if momentum[p] is None else momentum[p] * mu32 + mean
            momentum[p] = buf
            pending[p] = (step + tau, anchors[p] - lr32 * (mean + mu32 * buf))
        for p, (at, _) in sorted(pending.items()):
            if at <= step:
                merge(p)
    for p in sorted(pending):
        merge(p)
    return np.concatenate(anchors), [torch.cat([t.reshape(-1) for t in ps]).detach().numpy()
                                     for ps in params]


async def test_streaming_rounds_equal_single_process_reference(coordinator, replicas, tmp_path):
    sdl = dict(h=6, p=3, tau=2, alpha=0.5, min_replicas=3, round_timeout=60, steps=30)
    for i in range(3):
        replicas.append(await Replica.start(tmp_path, coordinator.address, i, **sdl))
    results = [await r.result() for r in replicas]
    glob, local = reference(3, 30, 6, 3, 2, 0.5)
    for i, res in enumerate(results):
        assert res["rounds"] == [5, 5, 5] and res["late"] == 0
        np.testing.assert_allclose(res["global"], glob, rtol=0, atol=2e-6)
        np.testing.assert_allclose(res["params"], local[i], rtol=0, atol=2e-6)
    view = rounds_view(coordinator.rounds, "sdl")
    assert [f.rounds for f in view.fragments] == [5, 5, 5]
    assert all(list(f.last_participants) == ["r0", "r1", "r2"] for f in view.fragments)


async def test_killed_and_stopped_replicas_leave_the_rounds_to_the_rest(
        start_coordinator, replicas, tmp_path):
    coordinator = await start_coordinator(metrics_port=0)
    # round_timeout 5 s: long enough that a loaded machine never stalls a survivor past it.
    sdl = dict(h=4, p=2, tau=1, alpha=0.5, min_replicas=2, round_timeout=5, steps=48,
               sleep=0.05)
    for i in range(4):
        replicas.append(await Replica.start(tmp_path, coordinator.address, i, **sdl))
    await asyncio.gather(*(r.reach(8) for r in replicas))
    replicas[2].proc.kill()
    replicas[3].proc.send_signal(signal.SIGSTOP)
    survivors = [await r.result() for r in replicas[:2]]
    assert survivors[0]["rounds"] == survivors[1]["rounds"]
    assert survivors[0]["global"] == survivors[1]["global"]
    assert min(survivors[0]["rounds"]) >= 11  # 12 rounds per fragment in 48 steps
    view = rounds_view(coordinator.rounds, "sdl")
    by_name = {r.replica: r for r in view.replicas}
    assert by_name["r2"].missed >= 1 and by_name["r3"].missed >= 1
    assert by_name["r0"].missed == by_name["r1"].missed == 0
    assert all(list(f.last_participants) == ["r0", "r1"] for f in view.fragments)
    # Operators see the same in /metrics, the status page and gradstar admin.
    _, _, metrics = await http_get(coordinator.metrics_port, "/metrics")
    assert re.search(rb'gradstar_replica_rounds_missed_total\{job="sdl",replica="r2"\} [1-9]',
                     metrics), metrics
    assert b'gradstar_round_replicas{job="sdl",model="global",fragment="0"} 2' in metrics
    _, _, status = await http_get(coordinator.metrics_port, "/status.json")
    rounds = json.loads(status)["rounds"][0]
    assert rounds["job"] == "sdl" and rounds["fragments"][0]["replicas"] == ["r0", "r1"]
    admin = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gradstar", "admin", "rounds", "--job", "sdl", "--json",
        "--coordinator", coordinator.address, stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(admin.communicate(), 60)
    listed = {r["replica"]: r for r in json.loads(out)["replicas"]}
    assert listed["r3"]["missed"] >= 1 and listed["r0"]["joins"] == 1


async def test_late_replica_catches_up_and_ends_with_the_same_global_model(
        coordinator, replicas, tmp_path):
    sdl = dict(h=4, p=2, tau=1, alpha=0.5, min_replicas=2, round_timeout=20, steps=48,
               sleep=0.08)
    gate = tmp_path / "go"
    for i in range(3):
        replicas.append(await Replica.start(tmp_path, coordinator.address, i, **sdl,
                                            wait_for=gate if i == 2 else ""))
    await replicas[0].reach(12)
    gate.touch()
    results = [await r.result() for r in replicas]
    # It took up the schedule, not step 0; and joined before the others' last step (where it
    # joins in between is how fast it started: the others' 36 steps after the gate are ~3 s).
    assert 8 <= results[2]["joined_at"] < 48
    assert results[2]["rounds"] == results[0]["rounds"] == results[1]["rounds"] == [12, 12]
    assert results[2]["global"] == results[0]["global"] == results[1]["global"]
    view = rounds_view(coordinator.rounds, "sdl")
    assert all(list(f.last_participants) == ["r0", "r1", "r2"] for f in view.fragments)
    assert {r.replica: r.joins for r in view.replicas}["r2"] == 1


async def test_global_model_survives_a_coordinator_restart(start_coordinator, replicas,
                                                           tmp_path):
    state = tmp_path / "state"
    first = await start_coordinator(state_dir=state)
    sdl = dict(h=4, p=2, tau=0, alpha=0.0, min_replicas=2, round_timeout=20, steps=16)
    for i in range(2):
        replicas.append(await Replica.start(tmp_path, first.address, i, **sdl))
    before = [await r.result() for r in replicas]
    await first.stop(grace=0)
    second = await start_coordinator(state_dir=state)
    client = RoundsClient(ClientSettings(coordinator=second.address, job="sdl"), "probe")
    try:
        fetched = [await client.fetch("global", p, 0, 20) for p in range(2)]
    finally:
        await client.close()
    assert [r for r, _ in fetched] == before[0]["rounds"] == [4, 4]
    np.testing.assert_array_equal(np.concatenate([g for _, g in fetched]),
                                  np.asarray(before[0]["global"], dtype=np.float32))
    # Training goes on from there: new replicas join at round 4 and step 16.
    replicas.clear()
    sdl["steps"] = 24
    for i in range(2):
        replicas.append(await Replica.start(tmp_path, second.address, i, **sdl))
    after = [await r.result() for r in replicas]
    assert after[0]["rounds"] == [6, 6] and after[0]["joined_at"] == 16


async def test_agent_restarts_a_killed_replica_which_rejoins_the_rounds(coordinator, tmp_path):
    """The worker agent restarts only the killed rank; the restarted replica (same name) joins
    the next rounds from the hub's model, and every replica ends with the same global model."""
    env = _env(coordinator.address, 0, h=4, p=2, tau=1, alpha=0.5, min_replicas=2,
               round_timeout=5, steps=80, sleep=0.08)
    del env["SDL_INDEX"], env["SDL_REPLICA"]  # the agent's ranks name the replicas
    agent = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gradstar", "worker", "--coordinator", coordinator.address,
        "--job", "sdl", "--nproc", "3", "--world-size", "3", "--max-restarts", "1",
        "--no-node-shard", "--", sys.executable, str(SCRIPT), str(tmp_path / "r{index}.json"),
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    lines: list[tuple[float, str]] = []
    loop = asyncio.get_running_loop()
    arrived = asyncio.Event()

    async def read():
        async for raw in agent.stdout:
            lines.append((loop.time(), raw.decode().rstrip()))
            arrived.set()

    async def until(condition) -> None:
        async with asyncio.timeout(120):
            while not condition():
                arrived.clear()
                await arrived.wait()

    reader = asyncio.create_task(read())
    try:
        await until(lambda: any(t.startswith("[rank 1] step 12") for _, t in lines))
        joined = next(t for _, t in lines if t.startswith("[rank 1] joined"))
        os.kill(int(joined.split(" pid ")[1].split()[0]), signal.SIGKILL)
        await until(lambda: sum(t.startswith("[rank 1] joined") for _, t in lines) >= 2)
        code = await asyncio.wait_for(agent.wait(), 180)
        await asyncio.wait_for(reader, 10)
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
    output = "\n".join(t for _, t in lines)
    assert code == 0, output[-4000:]
    rejoin = [(at, t) for at, t in lines if t.startswith("[rank 1] joined")][1]
    # It took up the schedule where the latest completed round began, not step 0.
    assert int(rejoin[1].split()[3]) >= 8, rejoin
    # How long the restart and the join took is a benchmark's matter
    # (benchmarks/streaming_diloco.py), not a test's: a loaded machine stretches both.
    results = [json.loads((tmp_path / f"r{i}.json").read_text()) for i in range(3)]
    assert results[0]["global"] == results[1]["global"] == results[2]["global"]
    assert results[0]["rounds"] == results[1]["rounds"] == results[2]["rounds"] == [20, 20]
    view = {r.replica: r for r in rounds_view(coordinator.rounds, "sdl").replicas}
    assert view["rank-1"].joins == 2 and view["rank-0"].joins == view["rank-2"].joins == 1


async def test_replicas_train_through_a_coordinator_restart(start_coordinator, replicas,
                                                            tmp_path):
    """The hub restarts mid-training on its port with its --state-dir: completed rounds are
    kept, replicas retry until it is back and send again what the open rounds lost."""
    state = tmp_path / "state"
    first = await start_coordinator(state_dir=state)
    sdl = dict(h=4, p=2, tau=1, alpha=0.5, min_replicas=2, round_timeout=20, steps=60,
               sleep=0.05)
    for i in range(2):
        replicas.append(await Replica.start(tmp_path, first.address, i, **sdl))
    await replicas[0].reach(16)
    await first.stop(grace=0)
    second = await start_coordinator(state_dir=state, port=first.port)
    results = [await r.result() for r in replicas]
    assert results[0]["rounds"] == results[1]["rounds"] == [15, 15]
    assert results[0]["global"] == results[1]["global"]
    assert [f.rounds for f in rounds_view(second.rounds, "sdl").fragments] == [15, 15]


async def test_a_replica_that_leaves_holds_no_round_back(coordinator, replicas, tmp_path):
    """A replica's StreamingDiLoCo.leave() tells the hub: its open rounds close with the
    others, and no later round waits for it. The rounds' timeout (10 min) is far past the
    test's bound, so a round that still waited for it would fail the test."""
    sdl = dict(h=4, p=2, tau=1, alpha=0.5, min_replicas=2, round_timeout=600, steps=24)
    # The leaver joins first and pauses 0.2 s a step: every round it takes part in waits for
    # it, so it is in the rounds when it leaves after 9 steps of its own.
    replicas.append(await Replica.start(tmp_path, coordinator.address, 2, leave_at=9,
                                        sleep=0.2, **sdl))
    await until(lambda: any(line.startswith("joined") for line in replicas[0].lines),
                "the leaver joined", 90)
    for i in range(2):
        replicas.append(await Replica.start(tmp_path, coordinator.address, i, **sdl))
    leaver, *results = [await r.result() for r in replicas]
    assert results[0]["global"] == results[1]["global"]
    assert results[0]["rounds"] == results[1]["rounds"] and min(results[0]["rounds"]) >= 5
    view = rounds_view(coordinator.rounds, "sdl")
    by_name = {r.replica: r for r in view.replicas}
    assert leaver["left"] and not results[0]["left"]
    assert by_name["r2"].missed == 0 and by_name["r2"].contributed >= 2  # left, not missed
    assert all(list(f.last_participants) == ["r0", "r1"] for f in view.fragments)
