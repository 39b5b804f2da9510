"""The hub lets go of what a rank let go: the shared-memory segments of ranks that exited
(cleanly or killed) are unmapped, and their descriptors closed, within seconds of the exit,
whatever the traffic; a finished collective is freed by reference counting alone.

The coordinator runs as its own process (``conftest.start_hub``) and its mappings and open
files are read from ``/proc/PID/maps`` and ``/proc/PID/fd``, as an operator would see them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal

import pytest

from gradstar.transport import shm

from ..integration.conftest import finish, spawn_ranks

#: How long the hub may keep a departed rank's segment: its sweep runs every half heartbeat
#: interval (1 s by default), so this leaves room for a loaded machine.
RELEASE_WITHIN_S = 15.0


def segments_mapped(pid: int) -> int:
    """Mappings of gradstar segments in process ``pid`` (one line each in /proc/PID/maps)."""
    with open(f"/proc/{pid}/maps") as maps:
        return sum(1 for line in maps if f"memfd:{shm.NAME}" in line)


def segment_fds(pid: int) -> int:
    """Descriptors of process ``pid`` open on gradstar segments."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"/memfd:{shm.NAME}")
    return count


async def released(pid: int) -> tuple[int, int]:
    """Poll until process ``pid`` maps no segment and holds no descriptor on one, or
    RELEASE_WITHIN_S passed: (mappings, descriptors) at the end."""
    for _ in range(int(RELEASE_WITHIN_S / 0.2)):
        if (held := (segments_mapped(pid), segment_fds(pid))) == (0, 0):
            break
        await asyncio.sleep(0.2)
    return held


@pytest.mark.skipif(not shm.supported(), reason="needs sealable memfds (Linux)")
@pytest.mark.timeout(90)
async def test_segments_of_ranks_that_exit_cleanly_are_unmapped_by_the_idle_hub(hub):
    proc, address = hub
    ranks = await spawn_ranks("big_allreduce", address, 2, "clean-exit", "32")
    for rank in ranks:
        code, out, err = await finish(rank, 60)
        assert code == 0, err[-2000:]
        result = json.loads(out.strip().splitlines()[-1])
        assert result["exact"] and result["shared_memory"], result
    # Nothing else happens on the hub from here: no attach, no collective, no join.
    mapped, fds = await released(proc.pid)
    assert (mapped, fds) == (0, 0), (
        f"{RELEASE_WITHIN_S:g} s after both ranks exited the idle hub still maps {mapped} of "
        f"their segments and holds {fds} descriptors on them")


@pytest.mark.skipif(not shm.supported(), reason="needs sealable memfds (Linux)")
@pytest.mark.timeout(90)
async def test_segments_of_a_rank_killed_mid_collective_are_unmapped(hub):
    proc, address = hub
    ranks = await spawn_ranks("allreduce_until_error", address, 2, "killed")
    try:
        # A few collectives through shared memory, so that both ranks' segments are mapped.
        for _ in range(3):
            line = await asyncio.wait_for(ranks[1].stdout.readline(), 60)
            assert b"progress" in line, line
        assert segments_mapped(proc.pid) >= 2
        ranks[1].send_signal(signal.SIGKILL)
        _, out, _ = await finish(ranks[0], 60)
        assert json.loads(out.strip().splitlines()[-1])["error"] == "RankLostError"
    finally:
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                rank.kill()
            await rank.wait()
    mapped, fds = await released(proc.pid)
    assert (mapped, fds) == (0, 0), (
        f"{RELEASE_WITHIN_S:g} s after rank 1 was killed and rank 0 exited the hub still maps "
        f"{mapped} of their segments and holds {fds} descriptors on them")
