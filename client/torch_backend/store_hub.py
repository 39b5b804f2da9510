"""A hub found or made through torch's own store, for ``init_method="env://"`` with nothing set.

torchrun, Lightning and Accelerate give every rank a shared store (``env://``: MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE) and nothing else. When the gradstar backend is asked for the
default group and no coordinator is configured (no ``GRADSTAR_COORDINATOR``, no host in a
``gradstar://`` URL), the ranks agree on a hub through that store:

- rank 0 starts ``gradstar coordinator`` as a child Python process on a free port, with a
  fresh random job token in its environment, and publishes the hub's address, the token and a
  fresh job name in the store;
- every other rank waits for those keys (up to the group's timeout) and joins that hub.

The keys carry torchelastic's restart count, so a restarted round (every worker started again)
gets a new hub and a new job, never a stale one. The hub lives as long as rank 0's default
group: destroying it stops the hub (SIGTERM: it drains, then exits) without waiting for the
hub's process to end, which takes a few hundred milliseconds that ``destroy_process_group``
need not spend; rank 0's exit hook waits for it (:func:`reap_stopped`), and the hub exits by
itself if rank 0's process dies (Linux: a parent-death signal). It is a separate process
rather than a thread in rank 0, so it neither shares rank 0's interpreter lock nor brings the
hub's code into a training process. Starting it is most of the time rank 0 spends joining: a
Python interpreter that imports grpc, numpy and pydantic (0.6-1.2 s on the 2-core development
machine, more under load; benchmarks/join_leave.py); a coordinator that is already running
(``GRADSTAR_COORDINATOR``) saves it.

Where the hub listens: 127.0.0.1 when every rank is on this host (``LOCAL_WORLD_SIZE`` equals
the world size, as under ``torchrun --standalone``), else every interface, advertised as
``GRADSTAR_ADVERTISE_HOST`` or this host's name. ``GRADSTAR_SHARDS`` sets its shards (default 0).
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

from gradstar.errors import ConfigurationError

log = logging.getLogger(__name__)

#: How long rank 0 waits for its hub to print its address.
START_TIMEOUT = 60.0
_PR_SET_PDEATHSIG = 1


@dataclass
class StoreHub:
    """Where the default group's hub is; ``process`` is set on rank 0, which owns it."""

    address: str
    token: str
    job: str
    process: subprocess.Popen | None = None

    def stop(self, timeout: float = 10.0, *, wait: bool = True) -> None:
        """Rank 0: stop the hub (it drains running calls first, then exits; killed if it has
        not exited ``timeout`` seconds later). ``wait=False`` returns at once and leaves the
        waiting to :func:`reap_stopped`. Idempotent."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        if wait:
            _reap(proc, timeout)
        else:
            with _stopping_lock:
                _stopping.append(proc)


#: Hubs told to stop by ``stop(wait=False)`` and not reaped yet.
_stopping: list[subprocess.Popen] = []
_stopping_lock = threading.Lock()


def _reap(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(max(timeout, 0.0))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def reap_stopped(timeout: float = 10.0) -> None:
    """Wait for the hubs stopped without waiting to exit, killing those still running after
    ``timeout`` seconds in all (the exit hook calls this)."""
    deadline = time.monotonic() + timeout
    with _stopping_lock:
        procs = list(_stopping)
        _stopping.clear()
    for proc in procs:
        _reap(proc, deadline - time.monotonic())


def _keys() -> tuple[str, str, str]:
    round_ = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"gradstar/hub/{round_}/"
    return prefix + "address", prefix + "token", prefix + "job"


# How the hub process starts: ``gradstar coordinator ARGS`` that first asks for SIGTERM when
# the rank that started it dies (Linux's parent-death signal; elsewhere the hub outlives a killed
# rank 0 until its jobs time out), and exits if that rank died before it asked. Done in the
# child's own code rather than in a ``preexec_fn``, which makes Python fork the whole training
# process instead of spawning the child cheaply: 50-80 ms of rank 0's join, measured.
_BOOTSTRAP = f"""\
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl({_PR_SET_PDEATHSIG}, signal.SIGTERM)
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
from gradstar.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _listen_host(world_size: int) -> tuple[str, str]:
    """(bind host, advertised host) for the hub."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if local >= world_size:
        return "127.0.0.1", "127.0.0.1"
    return "0.0.0.0", os.environ.get("GRADSTAR_ADVERTISE_HOST") or socket.gethostname()


def _start(world_size: int) -> StoreHub:
    bind, advertise = _listen_host(world_size)
    token = secrets.token_urlsafe(32)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSTAR_")}
    env.update(GRADSTAR_TOKEN=token, GRADSTAR_ADMIN_TOKEN=token)
    command = [sys.executable, "-u", "-c", _BOOTSTRAP, str(os.getpid()), "coordinator",
               "--host", bind, "--port", "0", "--shards", os.environ.get("GRADSTAR_SHARDS", "0"),
               "--log-level", "WARNING"]
    proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            text=True)
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, name="gradstar-hub-stdout", daemon=True).start()
    port = None
    try:
        while port is None:
            line = lines.get(timeout=START_TIMEOUT)
            if line is None:
                raise ConfigurationError(
                    f"rank 0 could not start a gradstar coordinator for this job (it exited "
                    f"with {proc.wait()}); set GRADSTAR_COORDINATOR to a running one")
            if "listening on" in line:
                port = int(line.rsplit(":", 1)[1])
    except queue.Empty:
        proc.kill()
        raise ConfigurationError(
            f"rank 0's gradstar coordinator did not start within {START_TIMEOUT:g} s; set "
            "GRADSTAR_COORDINATOR to a running one") from None
    job = f"torch-{uuid.uuid4().hex[:12]}"
    return StoreHub(f"{advertise}:{port}", token, job, proc)


def find_or_make(store, rank: int, world_size: int, timeout: timedelta) -> StoreHub:
    """The default group's hub, through torch's ``store`` (see the module docstring).

    Raises:
        ConfigurationError: rank 0 could not start its hub, or this rank found no hub in the
            store within ``timeout`` (naming what to set).
    """
    address_key, token_key, job_key = _keys()
    if rank == 0:
        hub = _start(world_size)
        store.set(token_key, hub.token)
        store.set(job_key, hub.job)
        store.set(address_key, hub.address)  # last: the others wait for this one
        log.info("rank 0 started a gradstar coordinator at %s for job %s", hub.address, hub.job)
        return hub
    try:
        store.wait([address_key], timeout)
    except RuntimeError as error:  # torch's store raises a plain RuntimeError on its timeout
        raise ConfigurationError(
            f"Timed out: rank {rank} found no gradstar coordinator in torch's store within "
            f"{timeout.total_seconds():g} s: rank 0 starts one when GRADSTAR_COORDINATOR is not "
            "set; is rank 0 running with backend='gradstar', or set GRADSTAR_COORDINATOR "
            f"({error})") from None
    return StoreHub(store.get(address_key).decode(), store.get(token_key).decode(),
                    store.get(job_key).decode())
