"""A real etcd for the ``--ha`` benchmarks and tests: Debian's etcd-server (``make etcd``)
started on 127.0.0.1 with free ports and its data in a folder of the caller's."""

from __future__ import annotations

import contextlib
import shutil
import socket
import ssl
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


def start_etcd(data_dir: Path, seconds: float = 20.0, tls: dict[str, Path] | None = None,
               ) -> tuple[subprocess.Popen, str]:
    """etcd on 127.0.0.1 (three tries: a free port can be taken between the look and etcd's
    bind); the process and its client URL as ``--ha`` takes it (``etcd://127.0.0.1:PORT``).
    With ``tls`` (``ca``, ``server``, ``server_key``, ``client``, ``client_key`` paths, as
    tests/integration/certs.py makes them) it serves https:// with that certificate and takes
    only clients with a certificate of that CA (``--client-cert-auth``).

    Raises:
        AssertionError: no etcd on PATH (:data:`MISSING`), or it did not start.
    """
    binary = shutil.which("etcd")
    assert binary, MISSING
    scheme = "http" if tls is None else "https"
    secure = [] if tls is None else [
        "--cert-file", str(tls["server"]), "--key-file", str(tls["server_key"]),
        "--client-cert-auth", "--trusted-ca-file", str(tls["ca"])]
    for _ in range(3):
        client, peer = free_port(), free_port()
        proc = subprocess.Popen(
            [binary, "--name", "gs-etcd", "--data-dir", str(data_dir / f"etcd-{client}"),
             "--listen-client-urls", f"{scheme}://127.0.0.1:{client}",
             "--advertise-client-urls", f"{scheme}://127.0.0.1:{client}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"gs-etcd=http://127.0.0.1:{peer}", *secure],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if _answers(client, proc, seconds, tls):
            return proc, f"etcd://127.0.0.1:{client}"
        stop_etcd(proc)
    raise AssertionError("etcd did not start on 127.0.0.1 (three tries)")


def _answers(port: int, proc: subprocess.Popen, seconds: float,
             tls: dict[str, Path] | None = None) -> bool:
    """Whether etcd on ``port`` reports itself healthy within ``seconds``."""
    context, scheme = None, "http"
    if tls is not None:
        context, scheme = ssl.create_default_context(cafile=str(tls["ca"])), "https"
        context.load_cert_chain(str(tls["client"]), str(tls["client_key"]))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}/health", timeout=1,
                                        context=context) as r:
                if b'"health":"true"' in r.read():
                    return True
        time.sleep(0.1)
    return False


def stop_etcd(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)
