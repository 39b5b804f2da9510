"""A job across the hosts of a namespaced network (:func:`tests.runtime.netns.service_network`),
started as a user starts one: a coordinator on the first host and ``gradstar worker`` on every
host (each runs its ranks and, by default, its node-local shard). The rank programs report
each phase as ``OUT/PHASE-RANK.json``; :func:`wait_reports` reads them. :func:`hosts_network`
gives the hosts, and fails the test where namespaces cannot be built."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.runtime.conftest import clean_env
from tests.runtime.netns import ServiceNetwork, service_network

REPO = Path(__file__).resolve().parents[2]


@contextmanager
def hosts_network(names: list[str], **cluster_options) -> Iterator[ServiceNetwork]:
    """:func:`service_network` of ``names`` as network namespaces (``cluster_options`` as it
    takes them, e.g. ``rtt=100``); the test fails, saying why, where they cannot be built (its
    loopback fallback would prove nothing about hosts)."""
    with service_network(names, **cluster_options) as network:
        if network.kind != "netns":
            pytest.fail(f"no emulated cluster here: {network.reason}", pytrace=False)
        yield network


def wait_reports(out: Path, phase: str, count: int, procs: list, timeout: float,
                 ranks: list[int] | None = None) -> list[dict]:
    """The reports of ``phase``: ``count`` of them, or those of ``ranks`` when given; the test
    fails, quoting what exited processes printed, if they are not all there in ``timeout`` s."""
    deadline = time.monotonic() + timeout

    def missing(found: list[Path]) -> bool:
        if ranks is None:
            return len(found) < count
        return not {out / f"{phase}-{r}.json" for r in ranks} <= set(found)

    while missing(found := sorted(out.glob(f"{phase}-*.json"))):
        if time.monotonic() > deadline:
            logs = "\n".join(p.stdout.read1(1 << 16).decode(errors="replace")
                             for p in procs if p.poll() is not None)
            pytest.fail(f"{len(found)} of {count} ranks reported phase {phase!r} within "
                        f"{timeout:g} s; exited processes said:\n{logs[-4000:]}")
        time.sleep(0.1)
    return [json.loads(p.read_text()) for p in found]


def starter(network, token: Path, procs: list[subprocess.Popen],
            ) -> Callable[..., subprocess.Popen]:
    """``start(host, argv, **env)``: run a process on a host of ``network`` (a session of its
    own, the ``token`` file and the repository on its path, its output piped), kept in
    ``procs``."""
    def start(host: str, argv: list[str], **env: str) -> subprocess.Popen:
        proc = subprocess.Popen(network.argv(host, argv), cwd=REPO, start_new_session=True,
                                env=clean_env(GRADSTAR_TOKEN_FILE=str(token),
                                              PYTHONPATH=str(REPO), **env),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc
    return start


@contextmanager
def coordinator_on_hosts(network, tmp_path: Path, coordinator_args: Sequence[str] = (),
                         ) -> Iterator[tuple[list[subprocess.Popen], subprocess.Popen,
                                             Callable[..., subprocess.Popen]]]:
    """Start the coordinator on the network's first host; yields (every process, the
    coordinator: its ``address``, a fresh ``job`` name and the ``token`` file set on it, and
    ``start(host, argv, **env)``, which runs a process on a host with the token and the
    repository on its path, its output piped) and kills them all when the block ends."""
    token = tmp_path / "token"
    token.write_text(secrets.token_urlsafe() + "\n")
    procs: list[subprocess.Popen] = []
    start = starter(network, token, procs)

    try:
        first = next(iter(network.addresses))
        hub = start(first, [sys.executable, "-m", "gradstar", "coordinator", "--host",
                            "0.0.0.0", "--port", "0", "--shards", "0", *coordinator_args])
        line = b""
        while b"listening on" not in line:  # bounded by the test's timeout
            line = hub.stdout.readline()
            assert line, "the coordinator exited before it listened"
        hub.address = f"{network.addresses[first]}:{int(line.rsplit(b':', 1)[1])}"
        hub.job, hub.token = f"cluster-{secrets.token_hex(3)}", token
        yield procs, hub, start
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@contextmanager
def job_on_hosts(network, tmp_path: Path, per_host: int | Sequence[int], rank_argv: list[str],
                 env_for: dict[str, dict[str, str]] | None = None,
                 coordinator_args: Sequence[str] = (), worker_args: Sequence[str] = (),
                 ) -> Iterator[tuple[list[subprocess.Popen], subprocess.Popen]]:
    """Start the coordinator on the network's first host and a worker running ``per_host``
    ranks of ``rank_argv`` on every host (a sequence: so many on each host, in order;
    ``env_for[host]``: extra environment for its ranks; ``coordinator_args`` and
    ``worker_args``: more flags for those commands);
    yields (every process, the coordinator: its ``address``, ``job`` and ``token`` file set on
    it, for a process the test starts itself) and kills them all when the block ends."""
    names = list(network.addresses)
    counts = [per_host] * len(names) if isinstance(per_host, int) else list(per_host)
    with coordinator_on_hosts(network, tmp_path, coordinator_args) as (procs, hub, start):
        for host, count in zip(names, counts, strict=True):
            start(host, [sys.executable, "-m", "gradstar", "worker", "--coordinator",
                         hub.address, "--job", hub.job, "--nproc", str(count),
                         "--world-size", str(sum(counts)), *worker_args, "--", *rank_argv],
                  CLUSTER_HOST=host, **(env_for or {}).get(host, {}))
        yield procs, hub


SCRIPT = REPO / "tests" / "tools" / "torchrun_script.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
#: torch's store on the first host: a fixed port is safe here, each host is a fresh namespace.
TORCHRUN_PORT = 29531


def _torchrun_env(backend: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GRADSTAR_", "MASTER_", "TORCHELASTIC_", "GLOO_"))}
    env["PYTHONPATH"] = str(REPO)
    if backend == "gloo":
        env["GLOO_SOCKET_IFNAME"] = "eth0"  # what gloo needs across hosts
    return env


def torchrun_on_hosts(network, out: Path, backend: str, hosts: Sequence[str],
                      nproc: int) -> list[subprocess.CompletedProcess]:
    """``tests/tools/torchrun_script.py BACKEND OUT`` under torchrun on every host of
    ``hosts`` (``nproc`` ranks each, the store on the first), with nothing of gradstar's set:
    each host's finished process, in host order (killed if one outlives 180 s)."""
    master = network.addresses[hosts[0]]
    procs = []
    for node, host in enumerate(hosts):
        command = [str(TORCHRUN), f"--nnodes={len(hosts)}", f"--node-rank={node}",
                   f"--nproc-per-node={nproc}", f"--master-addr={master}",
                   f"--master-port={TORCHRUN_PORT}", str(SCRIPT), backend, str(out)]
        procs.append(subprocess.Popen(network.argv(host, command), env=_torchrun_env(backend),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      cwd=REPO))
    done = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=180)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return done
