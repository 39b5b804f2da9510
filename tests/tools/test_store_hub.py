"""The hub rank 0 starts through torch's store (``store_hub``): how it stops, and that it goes
when the rank that started it dies. Real hub processes on 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from gradstar.client.torch_backend import store_hub

from .test_torchrun import refused

pytestmark = pytest.mark.timeout(120)


def running(pid: int) -> bool:
    """Whether process ``pid`` (not our child) runs: exists and is not a zombie waiting for
    whoever adopted it to reap it."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def gone(pid: int, within: float) -> bool:
    """Whether process ``pid`` has stopped running within ``within`` seconds."""
    deadline = time.monotonic() + within
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not running(pid)


def test_a_hub_stopped_without_waiting_is_reaped_by_the_exit_hook():
    hub = store_hub._start(2)
    proc = hub.process
    try:
        assert hub.address.startswith("127.0.0.1:") and not refused(hub.address)
        hub.stop(wait=False)  # destroy_process_group: SIGTERM, no waiting
        assert hub.process is None
        store_hub.reap_stopped(timeout=30)  # rank 0's exit hook
        assert proc.returncode is not None
        assert refused(hub.address)
        hub.stop(wait=False)  # idempotent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_the_hub_goes_when_the_rank_that_started_it_is_killed():
    code = textwrap.dedent("""
        import time
        from gradstar.client.torch_backend import store_hub
        hub = store_hub._start(2)
        print(hub.process.pid, hub.address, flush=True)
        time.sleep(120)
    """)
    rank0 = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        line = rank0.stdout.readline()  # bounded by the test's timeout
        pid, address = int(line.split()[0]), line.split()[1]
        assert not refused(address)
        rank0.send_signal(signal.SIGKILL)
        rank0.wait(10)
        assert gone(pid, 30), "the hub outlived the rank that started it"
    finally:
        if rank0.poll() is None:
            rank0.kill()
            rank0.wait(10)
        if pid is not None and running(pid):
            os.kill(pid, signal.SIGKILL)
