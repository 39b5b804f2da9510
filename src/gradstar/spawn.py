"""Server processes (a coordinator, a node-local shard) that a training or agent process starts
for itself and that must not outlive it.

A child is ``gradstar ARGS`` run by a small bootstrap that first asks for SIGTERM when the
process that started it dies (Linux's parent-death signal; elsewhere the child outlives a killed
starter until its own timeouts end it), and exits if that starter died before it asked. Done in
the child's own code rather than in a ``preexec_fn``, which makes Python fork the whole training
process instead of spawning the child cheaply (what that cost rank 0's join:
docs/performance.md, "Figures behind the code").

:func:`start` waits for the line the child prints once it serves (``... listening on ...``);
:func:`stop` sends SIGTERM (the child drains, then exits), waiting for it or leaving the wait to
:func:`reap_stopped`, which an exit hook calls.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

from gradstar.errors import ConfigurationError

_PR_SET_PDEATHSIG = 1

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

#: Children told to stop by ``stop(wait=False)`` and not reaped yet.
_stopping: list[subprocess.Popen] = []
_stopping_lock = threading.Lock()


def start(args: list[str], env: dict[str, str], what: str, timeout: float,
          ready: str = "listening on") -> tuple[subprocess.Popen, str]:
    """Start ``gradstar ARGS`` as a child of this process; return it and the first line of its
    stdout that contains ``ready``.

    Raises:
        ConfigurationError: the child exited first (with the last lines it printed on stderr
            left on this process's stderr), or printed no such line within ``timeout`` seconds
            (then it is killed). ``what`` names it in the message.
    """
    command = [sys.executable, "-u", "-c", _BOOTSTRAP, str(os.getpid()), *args]
    proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            text=True)
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, name="gradstar-child-stdout", daemon=True).start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.0))
            if line is None:
                raise ConfigurationError(f"{what} exited with {proc.wait()} before it served")
            if ready in line:
                return proc, line.strip()
    except queue.Empty:
        proc.kill()
        proc.wait()
        raise ConfigurationError(f"{what} did not start within {timeout:g} s") from None


def _reap(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(max(timeout, 0.0))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stop(proc: subprocess.Popen | None, timeout: float = 10.0, *, wait: bool = True) -> None:
    """SIGTERM ``proc`` (it drains, then exits); wait up to ``timeout`` seconds and kill it
    then, or with ``wait=False`` return at once and leave the wait to :func:`reap_stopped`."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    if wait:
        _reap(proc, timeout)
    else:
        with _stopping_lock:
            _stopping.append(proc)


def reap_stopped(timeout: float = 10.0) -> None:
    """Wait for the children stopped without waiting to exit, killing those still running after
    ``timeout`` seconds in all."""
    deadline = time.monotonic() + timeout
    with _stopping_lock:
        procs = list(_stopping)
        _stopping.clear()
    for proc in procs:
        _reap(proc, deadline - time.monotonic())


__all__ = ["reap_stopped", "start", "stop"]
