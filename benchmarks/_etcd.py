"""A real etcd for the ``--ha`` benchmarks and tests: Debian's etcd-server (``make etcd``)
started on 127.0.0.1 with free ports and its data in a folder of the caller's."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

MISSING = ("etcd is missing: the --ha coordinators need a real etcd; install Debian's "
           "etcd-server ('make etcd', or 'sudo apt-get install -y etcd-server')")


def free_port() -> int:
    """A port free on 127.0.0.1 now (for a process that takes no port 0, like etcd)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_etcd(data_dir: Path, seconds: float = 20.0) -> tuple[subprocess.Popen, str]:
    """etcd on 127.0.0.1 (three tries: a free port can be taken between the look and etcd's
    bind); the process and its client URL as ``--ha`` takes it (``etcd://127.0.0.1:PORT``).

    Raises:
        AssertionError: no etcd on PATH (:data:`MISSING`), or it did not start.
    """
    binary = shutil.which("etcd")
    assert binary, MISSING
    for _ in range(3):
        client, peer = free_port(), free_port()
        proc = subprocess.Popen(
            [binary, "--name", "gs-etcd", "--data-dir", str(data_dir / f"etcd-{client}"),
             "--listen-client-urls", f"http://127.0.0.1:{client}",
             "--advertise-client-urls", f"http://127.0.0.1:{client}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"gs-etcd=http://127.0.0.1:{peer}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if _answers(client, proc, seconds):
            return proc, f"etcd://127.0.0.1:{client}"
        stop_etcd(proc)
    raise AssertionError("etcd did not start on 127.0.0.1 (three tries)")


def _answers(port: int, proc: subprocess.Popen, seconds: float) -> bool:
    """Whether etcd on ``port`` reports itself healthy within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if b'"health":"true"' in r.read():
                    return True
        time.sleep(0.1)
    return False


def stop_etcd(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)
