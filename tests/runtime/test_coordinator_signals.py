"""``gradstar coordinator`` while it waits for its expected hub shards: it tells the port it bound
(shards on other hosts need it to register) and stops at once on SIGTERM or SIGINT, with its
local shard processes, instead of after the wait.

Every case runs the real command as a process, on 127.0.0.1:0, with a deadline on every wait.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from pathlib import Path

import pytest

from .conftest import GRADSTAR, Lines, clean_env, pid_alive, run_gradstar, stop_process

#: How long the coordinators below would wait for their shards: far beyond every bound here,
#: so that a coordinator which only gives up waiting cannot pass.
SHARD_WAIT = 120
#: The line printed as soon as the port is bound, before any shard registered.
BOUND = r"^gradstar coordinator bound to 127\.0\.0\.1:(\d+); waiting up to 120 s for hub shards"


async def start_waiting(*args: str) -> tuple[asyncio.subprocess.Process, Lines, Lines]:
    """A coordinator on 127.0.0.1:0 that waits for shards: (process, stdout, stderr), once it
    printed the port it bound."""
    proc = await asyncio.create_subprocess_exec(
        *GRADSTAR, "coordinator", "--host", "127.0.0.1", "--port", "0", *args,
        env=clean_env(GRADSTAR_SHARD_WAIT=str(SHARD_WAIT)), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = Lines(proc.stdout), Lines(proc.stderr)
    try:
        await out.wait_for(BOUND, 30)
    except BaseException:
        await stop_process(proc)
        raise
    return proc, out, err


async def exit_code_after(proc, out: Lines, err: Lines, stopping, within: float) -> int:
    """Await ``stopping`` (which signals ``proc``), then ``proc``'s exit, at most ``within``
    seconds; read all it printed. ``proc`` is killed if anything fails on the way."""
    try:
        await stopping
        code = await asyncio.wait_for(proc.wait(), within)
    finally:
        await stop_process(proc)
    await out.finish()
    await err.finish()
    return code


def children(pid: int) -> set[int]:
    """The processes ``pid`` started (from any of its threads) and has not reaped."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found.update(int(c) for c in (task / "children").read_text().split())
        except FileNotFoundError:
            continue  # the thread ended meanwhile
    return found


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("sig", "local_shards"), [(signal.SIGTERM, 1), (signal.SIGINT, 0)],
                         ids=["SIGTERM-with-a-local-shard", "SIGINT-without"])
async def test_a_signal_while_waiting_for_shards_stops_the_coordinator_and_its_shards(
        sig, local_shards):
    # One shard more than it starts itself: it waits for one from another host.
    proc, out, err = await start_waiting("--shards", str(local_shards),
                                         "--expected-shards", str(local_shards + 1))
    try:
        if local_shards:
            # The local shard's own line (it shares the coordinator's stdout): it is up, and
            # the coordinator still waits for the remote one.
            await out.wait_for(r"^gradstar shard 0 listening on ", 60)
        shards = children(proc.pid)
        assert len(shards) == local_shards, shards
        proc.send_signal(sig)
        # Not the wait running out (SHARD_WAIT): the drain grace (5 s) and stopping the shards.
        code = await asyncio.wait_for(proc.wait(), 20)
    finally:
        await stop_process(proc)
    await out.finish()
    await err.finish()
    assert code == 0, err.text  # as a SIGTERM to a serving coordinator
    assert not [pid for pid in shards if pid_alive(pid)], "a local shard outlived its coordinator"
    assert not any("gradstar coordinator listening on" in line for line in out.lines), out.text
    assert f"stopped while waiting for hub shards ({local_shards} of {local_shards + 1} up)" \
        in err.text, err.text
    assert "Traceback" not in err.text, err.text


@pytest.mark.timeout(90)
async def test_port_0_with_expected_shards_prints_the_port_before_any_shard_registers():
    proc, out, _ = await start_waiting("--shards", "0", "--expected-shards", "1")
    try:
        port = int((await out.wait_for(BOUND, 1))[1])
        assert port != 0
        # The port takes calls already: up, but not serving without its shard.
        code, said, _ = await run_gradstar("admin", "health", "--coordinator",
                                           f"127.0.0.1:{port}", timeout=30)
        assert (code, said.strip()) == (1, "NOT_SERVING")
        assert not any("listening on" in line for line in out.lines), out.text
        assert proc.returncode is None
    finally:
        await stop_process(proc)
    assert proc.returncode == 0


@pytest.mark.timeout(90)
async def test_a_signal_while_a_shard_waits_for_its_coordinator_stops_it(tmp_path):
    # Nothing listens at the coordinator's address: the shard would retry for SHARD_WAIT.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        nobody = probe.getsockname()[1]
    proc = await asyncio.create_subprocess_exec(
        *GRADSTAR, "shard", "--coordinator", f"127.0.0.1:{nobody}", "--host", "127.0.0.1",
        "--port", "0", "--log-level", "INFO",
        env=clean_env(GRADSTAR_SHARD_WAIT=str(SHARD_WAIT)), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = Lines(proc.stdout), Lines(proc.stderr)

    async def wait_then_stop():
        await err.wait_for(r"registering with the coordinator at .* \(waiting up to 120 s\)",
                           30)
        proc.send_signal(signal.SIGTERM)

    code = await exit_code_after(proc, out, err, wait_then_stop(), 20)
    assert code == 0, err.text
    assert not any("listening on" in line for line in out.lines), out.text
    assert "Traceback" not in err.text, err.text


@pytest.mark.timeout(120)
async def test_ctrl_c_stops_the_coordinator_and_its_shards_without_a_restart():
    """Ctrl-C sends SIGINT to the terminal's whole foreground process group: the local shards
    must not get it (they used to die under the coordinator, which logged a shard failure and
    a restart); the coordinator stops them itself."""
    proc = await asyncio.create_subprocess_exec(
        *GRADSTAR, "coordinator", "--host", "127.0.0.1", "--port", "0", "--shards", "1",
        env=clean_env(GRADSTAR_SHARD_WAIT=str(SHARD_WAIT)), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True)  # its own process group, as a shell gives a foreground job
    out, err = Lines(proc.stdout), Lines(proc.stderr)
    shards: set[int] = set()

    async def ctrl_c():
        await out.wait_for(r"^gradstar coordinator listening on ", 60)
        shards.update(children(proc.pid))
        assert len(shards) == 1, shards
        # Outside the coordinator's process group, so the group's SIGINT cannot reach them.
        assert all(os.getpgid(pid) != os.getpgid(proc.pid) for pid in shards)
        os.killpg(proc.pid, signal.SIGINT)

    code = await exit_code_after(proc, out, err, ctrl_c(), 30)
    assert code == 0, err.text
    assert "restarting" not in err.text, err.text
    assert not [pid for pid in shards if pid_alive(pid)], "a local shard outlived its coordinator"
