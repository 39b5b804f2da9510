"""A sharded hub split over hosts: the coordinator, a ``gradstar shard`` and the ranks each in a
network namespace of their own on a private bridge (:mod:`tests.runtime.netns`), as on three
machines. Loopback where namespaces are not allowed; the test prints which ran.

The coordinator runs ``--shards 0 --expected-shards 1`` with real token files, the shard joins
it from its own address with ``--advertise-host``, and two rank processes on the third host
run their collectives through it: results exact against numpy, the stripe carried by the
shard (its counters and, in namespaces, its interface). Then the shard is SIGKILLed and both
ranks' next collective fails with ShardLostError naming it, long before its own timeout.

This module is also the rank program: ``python -m tests.integration.test_shard_hosts``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import secrets
import select
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from tests.runtime.conftest import GRADSTAR, Lines, clean_env, stop_process
from tests.runtime.netns import ServiceNetwork, service_network

from .conftest import communicate_or_kill

REPO = Path(__file__).resolve().parents[2]
HOSTS = ["coordinator", "shard", "ranks"]
WORLD = 2
# Small chunks so every tensor is many of them, with a short last one: no shape below is a
# multiple of the chunk.
CHUNK_BYTES = 4096
FLOAT_SHAPE = (997, 13)
INT_SHAPE = (3001,)
#: The collective timeout the ranks ask for: a lost shard must fail them long before it.
COLLECTIVE_TIMEOUT = 60.0
_NBYTES = 4 * FLOAT_SHAPE[0] * FLOAT_SHAPE[1] + 8 * INT_SHAPE[0]
#: What the shard must have received and sent at least: every rank sends each tensor twice
#: (all_reduce, all_gather); it gets the sum back, and every other rank's tensor.
PAYLOAD_IN = WORLD * 2 * _NBYTES
PAYLOAD_OUT = WORLD * (1 + WORLD - 1) * _NBYTES


def rank_inputs(rank: int) -> dict[str, np.ndarray]:
    """The tensors ``rank`` contributes: random values, so a wrong stripe cannot pass."""
    rng = np.random.default_rng(1000 + rank)
    return {"float32": rng.standard_normal(FLOAT_SHAPE).astype(np.float32),
            "int64": rng.integers(-(1 << 40), 1 << 40, size=INT_SHAPE, dtype=np.int64)}


# -- the rank program --------------------------------------------------------------------------


def _encode(x: np.ndarray) -> dict:
    return {"dtype": str(x.dtype), "shape": list(x.shape),
            "data": base64.b64encode(np.ascontiguousarray(x).tobytes()).decode()}


def _decode(d: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["data"]), d["dtype"]).reshape(d["shape"])


def rank_main() -> int:
    """Join from GRADSTAR_* settings, print the collectives' results as one JSON line, wait for
    a line on stdin, then print what the next all_reduce did (it should fail: the shard is
    gone). Exits 0 once both lines are out; a join or collective error before that ends it
    with status 3 and the error as JSON."""
    import gradstar
    from gradstar.errors import GradstarError

    try:
        with gradstar.init_process_group(timeout=COLLECTIVE_TIMEOUT, join_timeout=60,
                                         chunk_bytes=CHUNK_BYTES) as pg:
            xs = rank_inputs(pg.rank)
            results = {"rank": pg.rank, "shards": pg.shards}
            for name, x in xs.items():
                results[f"all_reduce/{name}"] = _encode(pg.all_reduce(x))
                results[f"all_gather/{name}"] = [_encode(a) for a in pg.all_gather(x)]
            print(json.dumps(results), flush=True)
            ready, _, _ = select.select([sys.stdin], [], [], 120)
            if not ready or not sys.stdin.readline():
                print(json.dumps({"fatal": "no go-ahead on stdin"}), flush=True)
                return 3
            started = time.monotonic()
            try:
                pg.all_reduce(xs["float32"])
                after = {"error": None}
            except GradstarError as error:
                after = {"error": type(error).__name__, "message": str(error),
                         "shard": getattr(error, "shard", None),
                         "seconds": time.monotonic() - started}
            print(json.dumps(after), flush=True)
    except GradstarError as error:
        print(json.dumps({"fatal": type(error).__name__, "message": str(error)}), flush=True)
        return 3
    return 0


# -- the hosts ---------------------------------------------------------------------------------


@dataclass
class Hosts:
    """The three hosts and every process started on them (stopped by the fixture)."""

    network: ServiceNetwork
    tokens: Path
    processes: list[asyncio.subprocess.Process] = field(default_factory=list)

    def ip(self, host: str) -> str:
        return self.network.addresses[host] if self.network.kind == "netns" else "127.0.0.1"

    @property
    def bind(self) -> str:
        # Namespaces: every interface, as in a container, so the token and --advertise-host
        # matter. Loopback: this machine only.
        return "0.0.0.0" if self.network.kind == "netns" else "127.0.0.1"

    def env(self, **extra: str) -> dict[str, str]:
        return clean_env(**{"GRADSTAR_TOKEN_FILE": str(self.tokens / "job"),
                            "GRADSTAR_ADMIN_TOKEN_FILE": str(self.tokens / "admin"), **extra})

    async def start(self, host: str, argv: list[str], env: dict[str, str], *,
                    stdin: bool = False, stderr=asyncio.subprocess.STDOUT,
                    ) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            *self.network.argv(host, argv), env=env, cwd=REPO,
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=stderr,
            limit=1 << 22)  # a rank's results are one long JSON line
        self.processes.append(proc)
        return proc

    async def gradstar(self, host: str, *args: str, env: dict[str, str] | None = None,
                       timeout: float = 60) -> tuple[int, str, str]:
        """``gradstar ARGS`` on ``host`` to completion: (status, stdout, stderr)."""
        proc = await self.start(host, [*GRADSTAR, *args], env or self.env(),
                                stderr=asyncio.subprocess.PIPE)
        out, err, hung = await communicate_or_kill(proc, timeout)
        assert not hung, f"`gradstar {' '.join(args)}` hung on {host}:\n{err.decode()[-3000:]}"
        return proc.returncode, out.decode(), err.decode()

    async def shards(self, coordinator: str) -> dict:
        """``gradstar admin shards --json``, asked from the ranks' host."""
        code, out, err = await self.gradstar("ranks", "admin", "shards", "--json",
                                             "--coordinator", coordinator, "--timeout", "10")
        assert code == 0, err
        return json.loads(out)


@pytest.fixture
async def hosts(tmp_path, capsys):
    tokens = tmp_path / "tokens"
    tokens.mkdir(mode=0o700)
    for name in ("job", "admin"):
        (tokens / name).write_text(secrets.token_urlsafe() + "\n", encoding="ascii")
    with service_network(HOSTS) as network:
        with capsys.disabled():  # say which network was used, even under -q
            print(f"\nshard hosts: {network.describe()}", flush=True)
        hosts = Hosts(network, tokens)
        try:
            yield hosts
        finally:
            for proc in reversed(hosts.processes):
                await stop_process(proc)


async def coordinator_port(log: Lines, timeout: float = 30) -> int:
    """The port a coordinator started with ``--port 0`` bound, from the line it prints before
    it waits for its expected shards (which need the port to register)."""
    return int((await log.wait_for(r"^gradstar coordinator bound to \S+:(\d+); ", timeout))[1])


async def shard_counters(hosts: Hosts, coordinator: str, timeout: float = 10) -> dict:
    """Slot 0 as ``admin shards`` lists it, once its report shows the collectives' bytes
    (shards report every second)."""
    deadline = time.monotonic() + timeout
    while True:
        listed = await hosts.shards(coordinator)
        (shard,) = listed["shards"]
        if shard["bytes_in"] >= PAYLOAD_IN and shard["bytes_out"] >= PAYLOAD_OUT:
            return shard
        assert time.monotonic() < deadline, (
            f"the shard's counters stayed at {shard}, expected {PAYLOAD_IN} in and "
            f"{PAYLOAD_OUT} out")
        await asyncio.sleep(0.5)


def check_results(results: dict, rank: int) -> None:
    """The rank's all_reduce and all_gather results, exactly as numpy computes them."""
    inputs = [rank_inputs(r) for r in range(WORLD)]
    for name in ("float32", "int64"):
        want = inputs[0][name] + inputs[1][name]  # two ranks: one rounding, in any order
        np.testing.assert_array_equal(_decode(results[f"all_reduce/{name}"]), want,
                                      err_msg=f"rank {rank} all_reduce {name}")
        gathered = [_decode(d) for d in results[f"all_gather/{name}"]]
        assert len(gathered) == WORLD
        for r in range(WORLD):
            np.testing.assert_array_equal(gathered[r], inputs[r][name],
                                          err_msg=f"rank {rank} all_gather {name} [{r}]")
            assert gathered[r].dtype == inputs[r][name].dtype


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


async def read_json(proc: asyncio.subprocess.Process, what: str, log: Path,
                    timeout: float) -> dict:
    """The rank's next JSON line (its stderr, in ``log``, explains a failure)."""
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout)
    except TimeoutError:
        raise AssertionError(f"no {what} within {timeout} s:\n{tail(log)}") from None
    assert line, f"the rank exited ({proc.returncode}) before its {what}:\n{tail(log)}"
    result = json.loads(line)
    assert "fatal" not in result, f"{result}\n{tail(log)}"
    return result


# -- the test ----------------------------------------------------------------------------------


# Usually about 20 s; every wait inside is bounded on its own so that a failure says where.
@pytest.mark.timeout(240)
async def test_a_shard_on_another_host_joins_serves_and_its_loss_is_named(hosts, tmp_path):
    coordinator_argv = [*GRADSTAR, "coordinator", "--host", hosts.bind, "--port", "0",
                        "--shards", "0", "--expected-shards", "1"]
    coordinator_proc = await hosts.start("coordinator", coordinator_argv, hosts.env())
    coordinator_log = Lines(coordinator_proc.stdout)
    port = await coordinator_port(coordinator_log)
    coordinator = f"{hosts.ip('coordinator')}:{port}"

    # Without its expected shard the coordinator is up but not serving.
    code, out, _ = await hosts.gradstar("ranks", "admin", "health", "--coordinator", coordinator)
    assert (code, out.strip()) == (1, "NOT_SERVING")

    shard_argv = [*GRADSTAR, "shard", "--coordinator", coordinator, "--host", hosts.bind,
                  "--port", "0", "--advertise-host", hosts.ip("shard"), "--slot", "0"]
    # A shard with the wrong admin token is refused and says so.
    (tmp_path / "wrong").write_text("not-the-admin-token\n", encoding="ascii")
    refused = await hosts.start("shard", shard_argv,
                                hosts.env(GRADSTAR_ADMIN_TOKEN_FILE=str(tmp_path / "wrong")),
                                stderr=asyncio.subprocess.PIPE)
    _, err, hung = await communicate_or_kill(refused, 30)
    assert not hung and refused.returncode == 1, (refused.returncode, err.decode())
    assert "refused" in err.decode() and "admin token wrong" in err.decode(), err.decode()

    shard_proc = await hosts.start("shard", shard_argv, hosts.env())
    shard_log = Lines(shard_proc.stdout)
    advertised = (await shard_log.wait_for(r"gradstar shard 0 listening on \S+ "
                                           r"\(advertised as (\S+)\)$", 30))[1]
    assert advertised.startswith(f"{hosts.ip('shard')}:")
    await coordinator_log.wait_for(r"gradstar coordinator listening on ", 30)
    await coordinator_log.wait_for(
        rf"gradstar coordinator data plane: 1 shards at {re.escape(advertised)}$", 5)
    code, out, err = await hosts.gradstar("ranks", "admin", "health", "--coordinator",
                                          coordinator, "--wait", "30")
    assert (code, out.strip()) == (0, "SERVING"), err
    listed = await hosts.shards(coordinator)
    assert listed["expected"] == 1
    assert [(s["slot"], s["address"], s["state"]) for s in listed["shards"]] == [
        (0, advertised, "up")]  # the refused shard took no slot
    netns = hosts.network.kind == "netns"
    before = {h: hosts.network.interface_bytes(h) for h in ("coordinator", "shard")} \
        if netns else {}

    # Two ranks on the third host. Hosts share no memory: everything goes over the network.
    rank_env = {"GRADSTAR_COORDINATOR": coordinator, "GRADSTAR_JOB": "hosts",
                "GRADSTAR_WORLD_SIZE": str(WORLD), "GRADSTAR_SHARED_MEMORY": "0",
                "GRADSTAR_TOKEN": (hosts.tokens / "job").read_text(encoding="ascii").strip()}
    logs = [tmp_path / f"rank{r}.log" for r in range(WORLD)]
    ranks = []
    for r in range(WORLD):
        with logs[r].open("wb") as log:
            ranks.append(await hosts.start(
                "ranks", [sys.executable, "-m", "tests.integration.test_shard_hosts"],
                clean_env(**rank_env, GRADSTAR_RANK=str(r)), stdin=True, stderr=log))
    results = [await read_json(p, "results", log, 60)
               for p, log in zip(ranks, logs, strict=True)]
    for r, result in enumerate(results):
        assert result["rank"] == r
        assert result["shards"] == [advertised]  # striped over the shard, not the coordinator
        check_results(result, r)

    # The shard carried the payload: its own counters, and (namespaces) its interface.
    shard = await shard_counters(hosts, coordinator)
    assert (shard["address"], shard["state"], shard["jobs"]) == (advertised, "up", ["hosts"])
    if netns:
        grew = {h: [now - then for now, then in zip(hosts.network.interface_bytes(h), was,
                                                    strict=True)]
                for h, was in before.items()}
        assert grew["shard"][0] >= PAYLOAD_IN and grew["shard"][1] >= PAYLOAD_OUT, grew
        # The coordinator got joins, heartbeats, the shard's reports and admin calls: a few
        # kB, not the payload.
        assert grew["coordinator"][0] < PAYLOAD_IN // 2, grew

    # The shard's host loses it: both ranks' next collective fails naming the shard.
    shard_proc.send_signal(signal.SIGKILL)
    assert await asyncio.wait_for(shard_proc.wait(), 10) == -signal.SIGKILL
    for proc in ranks:
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
    for r, (proc, log) in enumerate(zip(ranks, logs, strict=True)):
        after = await read_json(proc, "next collective", log, COLLECTIVE_TIMEOUT + 30)
        assert after["error"] == "ShardLostError", (r, after)
        assert after["shard"] == 0, (r, after)
        assert f"hub shard 0 at {advertised}" in after["message"], (r, after)
        assert after["seconds"] < COLLECTIVE_TIMEOUT, (r, after)  # not the timeout firing
        assert await asyncio.wait_for(proc.wait(), 30) == 0, tail(log)

    # The coordinator lists the slot as lost and stops serving until a shard is back.
    listed = await hosts.shards(coordinator)
    assert [(s["slot"], s["address"], s["state"]) for s in listed["shards"]] == [
        (0, advertised, "lost")]
    code, out, _ = await hosts.gradstar("ranks", "admin", "health", "--coordinator", coordinator)
    assert (code, out.strip()) == (1, "NOT_SERVING")


if __name__ == "__main__":
    raise SystemExit(rank_main())
