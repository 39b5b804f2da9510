"""Running benchmarks/cluster.py's topologies on an emulated cluster: its processes
(:class:`Process`), one run's state (:class:`Run`), the hub of a placement (:func:`start_hub`),
the samples of link counters and hub CPU around a timed loop, and a driver's whole run
(:func:`on_emulated_cluster`, :func:`measure_row`, :func:`print_failures`; cluster.py and
cluster_torch.py).
"""

from __future__ import annotations

import argparse
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from _cluster_model import COORDINATOR_PORT, REPO, Layout, Placement
from _harness import (
    BenchmarkError,
    cpu_seconds_of,
)
from emulated_cluster import (
    ClusterUnavailable,
    EmulatedCluster,
    LinkBytes,
)

# -- running a topology -------------------------------------------------------------------------


@dataclass
class Process:
    """A process in a host, its output in a log file; :meth:`wait_for` a line of it."""

    name: str
    proc: subprocess.Popen
    log: Path
    lines: queue.Queue = field(default_factory=queue.Queue)

    def start_reader(self) -> None:
        def pump() -> None:
            with self.log.open("a") as out:
                for line in self.proc.stdout:
                    out.write(line)
                    out.flush()
                    self.lines.put(line)
            self.lines.put(None)

        threading.Thread(target=pump, daemon=True, name=f"{self.name}-out").start()

    def next_line(self, deadline: float, what: str) -> str:
        """The next line of output; raises BenchmarkError on exit or at ``deadline``."""
        try:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise BenchmarkError(f"{self.name}: no {what} in time\n{self.tail()}") from None
        if line is None:
            self.lines.put(None)
            raise BenchmarkError(f"{self.name} exited ({self.proc.wait()}) before {what}\n"
                                 f"{self.tail()}")
        return line

    def wait_for(self, text: str, deadline: float) -> str:
        while True:
            line = self.next_line(deadline, repr(text))
            if text in line:
                return line

    def tail(self, chars: int = 2500) -> str:
        return f"--- {self.name} ({self.log}) ---\n" + \
            self.log.read_text(errors="replace")[-chars:]


@dataclass
class Run:
    """What every row shares: the cluster, the layout, tokens, options, and a log folder."""

    cluster: EmulatedCluster
    layout: Layout
    args: argparse.Namespace
    logs: Path
    token: str = field(default_factory=secrets.token_urlsafe)
    admin_token: str = field(default_factory=secrets.token_urlsafe)

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADSTAR_", "GLOO_"))}
        return env | {"PYTHONUNBUFFERED": "1", **extra}

    def start(self, host: str, name: str, argv: Sequence[str], env: dict[str, str], *,
              stdin: bool = False) -> Process:
        log = self.logs / f"{name}.log"
        with log.open("w") as err:
            proc = self.cluster.popen(host, argv, env=env, cwd=REPO, text=True, bufsize=1,
                                      stdout=subprocess.PIPE, stderr=err,
                                      stdin=subprocess.PIPE if stdin else subprocess.DEVNULL)
        started = Process(name, proc, log)
        started.start_reader()
        return started


def start_hub(run: Run, label: str, placement: Placement, deadline: float) -> list[Process]:
    """Start ``placement``'s coordinator and shards and wait until the coordinator serves with
    all its shards; returns them, coordinator first."""
    env = run.env(GRADSTAR_TOKEN=run.token, GRADSTAR_ADMIN_TOKEN=run.admin_token)
    k = len(placement.shard_hosts)
    coordinator = run.start(placement.coordinator, f"{label}-coordinator", [
        sys.executable, "-u", "-m", "gradstar", "coordinator", "--host", "0.0.0.0",
        "--port", str(COORDINATOR_PORT), "--shards", "0", "--expected-shards", str(k),
        "--log-level", "WARNING"], env)
    hub = [coordinator]
    try:
        address = f"{run.cluster.address(placement.coordinator)}:{COORDINATOR_PORT}"
        if k:
            coordinator.wait_for("gradstar coordinator bound to", deadline)
        for slot, host in enumerate(placement.shard_hosts):
            where = (["--for-job", label] if placement.node_local else
                     ["--advertise-host", run.cluster.address(host)])
            hub.append(run.start(host, f"{label}-shard{slot}", [
                sys.executable, "-u", "-m", "gradstar", "shard", "--coordinator", address,
                "--host", "0.0.0.0", "--port", "0", *where, "--slot", str(slot),
                "--log-level", "WARNING"], env))
        coordinator.wait_for("gradstar coordinator listening on", deadline)
    except BaseException:
        run.cluster.stop_processes([p.proc for p in hub])
        raise
    return hub


def rank_env(run: Run, placement: Placement, job: str) -> dict[str, str]:
    if placement.coordinator is None:
        return run.env(GLOO_SOCKET_IFNAME="eth0")
    address = f"{run.cluster.address(placement.coordinator)}:{COORDINATOR_PORT}"
    return run.env(GRADSTAR_COORDINATOR=address, GRADSTAR_JOB=job, GRADSTAR_TOKEN=run.token,
                   GRADSTAR_WORLD_SIZE=str(run.layout.world_size))


@dataclass
class Sample:
    links: dict[str, LinkBytes]
    hub_cpu: float
    at: float


def sample(run: Run, hub: list[Process]) -> Sample:
    cpu = sum(cpu_seconds_of(p.proc.pid) or 0.0 for p in hub)
    return Sample(run.cluster.link_bytes(), cpu, time.monotonic())


# -- a driver's run ------------------------------------------------------------------------------

Outcome = tuple[list[dict], list[tuple[str, str]]]  # rows, and (what, error) of each failure


def on_emulated_cluster(script: str, names: list[str], args: argparse.Namespace, layout: Layout,
                        congestion: str | None, each: Callable[[Run], Outcome],
                        ) -> tuple[list[dict], list[tuple[str, str]], Path]:
    """Build hosts ``names`` linked at ``args.rate`` and run ``each`` on them; its rows and
    failures, and the folder of every process's output (removed when nothing failed). Exits
    with status 2 where no emulated cluster can be built here, 130 on Ctrl-C (after the
    cluster's processes and namespaces are gone); SIGTERM and SIGHUP end it the same way."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda s, _: sys.exit(128 + s))
    logs = Path(tempfile.mkdtemp(prefix=f"gradstar-{script}-"))
    failures: list[tuple[str, str]] = []
    try:
        with EmulatedCluster(names, rate=args.rate, congestion_control=congestion) as cluster:
            print(cluster.describe(), file=sys.stderr, flush=True)
            rows, failures = each(Run(cluster, layout, args, logs))
    except ClusterUnavailable as error:
        print(f"benchmarks/{script}.py: no emulated cluster here: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print(f"benchmarks/{script}.py: interrupted; its processes and namespaces are gone",
              file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        if not failures:
            shutil.rmtree(logs, ignore_errors=True)
    return rows, failures, logs


def measure_row(what: str, size_mb: float, timeout: float, measure: Callable[[float], dict],
                rows: list[dict], failures: list[tuple[str, str]]) -> None:
    """Run ``measure(deadline)`` for one row, say how it went on stderr, and add its row to
    ``rows`` or its error to ``failures``."""
    t0 = time.monotonic()
    try:
        row = measure(t0 + timeout)
    except BenchmarkError as error:
        failures.append((f"{what} {size_mb:g} MiB", str(error)))
        print(f"  {what:30s} {size_mb:6g} MiB FAILED", file=sys.stderr, flush=True)
        return
    rows.append(row)
    print(f"  {what:30s} {size_mb:6g} MiB median {row['median_s'] * 1e3:9.1f} ms "
          f"({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)


def print_failures(failures: list[tuple[str, str]], logs: Path) -> None:
    """Each failure with its error, and where every process's output was kept."""
    for name, error in failures:
        print(f"\nFAILED {name}:\n{error}")
    if failures:
        print(f"\nEvery process's output: {logs}")
