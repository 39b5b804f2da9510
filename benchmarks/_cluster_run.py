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
    parse_rtt,
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
        if not getattr(self.args, "nat_traversal", True):  # --no-nat-traversal: the shards'
            env["GRADSTAR_NAT_TRAVERSAL"] = "0"
        given = dict(w.split("=", 1) for w in getattr(self.args, "gradstar_env", ()))
        return env | given | {"PYTHONUNBUFFERED": "1", **extra}

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
    """Counters read at one moment: link bytes, the hub's CPU seconds, each delay line's CPU
    seconds and the frames the lines lost so far."""

    links: dict[str, LinkBytes]
    hub_cpu: float
    at: float
    line_cpu: dict[str, float] = field(default_factory=dict)
    line_lost: int = 0


def sample(run: Run, hub: list[Process]) -> Sample:
    cpu = sum(cpu_seconds_of(p.proc.pid) or 0.0 for p in hub)
    lost = sum(s.upload.lost + s.download.lost for s in run.cluster.delay_line_stats().values())
    return Sample(run.cluster.link_bytes(), cpu, time.monotonic(),
                  run.cluster.delay_line_cpu(), lost)


def line_columns(before: Sample, after: Sample) -> dict:
    """A row's delay-line fields over the interval: ``line_cpu`` the busiest line's CPU in
    cores (None without lines), ``line_cpu_s`` each line's CPU seconds, ``line_lost`` the
    frames the lines dropped."""
    spent = {h: after.line_cpu[h] - before.line_cpu[h] for h in after.line_cpu}
    cores = max(spent.values()) / (after.at - before.at) if spent else None
    return {"line_cpu": cores, "line_cpu_s": spent,
            "line_lost": after.line_lost - before.line_lost}


def add_far_link_arguments(parser: argparse.ArgumentParser) -> None:
    """``--rtt`` and ``--delay-line``, which :func:`on_emulated_cluster` reads."""
    parser.add_argument("--rtt", nargs="+", metavar="MS|HOST=MS",
                        help="round trips through a packet-level delay line: MS between every "
                             "two hosts, or HOST=MS ... each host's round trip to the core "
                             "(two hosts: the sum); default none, no delay line")
    parser.add_argument("--delay-line", action="store_true",
                        help="a delay line on every host link even at 0 ms (to measure it)")
    parser.add_argument("--host-sysctl", nargs="+", default=[], metavar="KEY=VALUE",
                        help="sysctls set in every host, as a host tuned for far links: e.g. "
                             "'net.ipv4.tcp_wmem=4096 16384 67108864' "
                             "net.ipv4.tcp_slow_start_after_idle=0")
    parser.add_argument("--gradstar-env", nargs="+", default=[], metavar="GRADSTAR_X=VALUE",
                        help="settings for every gradstar process of the run (the run clears "
                             "the caller's GRADSTAR_* variables), e.g. GRADSTAR_CONNECTIONS=4")
    parser.add_argument("--outbound-only", nargs="+", default=[], metavar="HOST",
                        help="hosts that take no inbound connections, as behind NAT (nftables "
                             "drops new inbound TCP on their links); gloo cannot run there")
    parser.add_argument("--no-nat-traversal", dest="nat_traversal", action="store_false",
                        help="with --outbound-only: their node-local shards take no punched "
                             "connections (GRADSTAR_NAT_TRAVERSAL=0), so stripes across hosts "
                             "go to the reachable hosts' shards only")


def far_description(args: argparse.Namespace) -> str:
    """The run's far links in words, for its header ("" without delay lines)."""
    if isinstance(args.rtt, dict):
        return ", round trips to the core (delay lines) " + ", ".join(
            f"{host} {ms:g} ms" for host, ms in args.rtt.items())
    tuned = "".join(f", {w}" for w in (*getattr(args, "host_sysctl", ()),
                                         *getattr(args, "gradstar_env", ())))
    if args.rtt or args.delay_line:
        return f", {args.rtt or 0:g} ms round trip between every two hosts (delay lines){tuned}"
    return tuned


def far_links(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Replace ``args.rtt``'s words by the round trip they say; a usage error if they say
    none."""
    if args.rtt is not None:
        try:
            args.rtt = parse_rtt(args.rtt)
        except ValueError as error:
            parser.error(str(error))
    for word in (*args.host_sysctl, *args.gradstar_env):
        if "=" not in word:
            parser.error(f"--host-sysctl and --gradstar-env take KEY=VALUE: {word!r}")
    if any(not w.startswith("GRADSTAR_") for w in args.gradstar_env):
        parser.error("--gradstar-env sets GRADSTAR_* variables only")


# -- a driver's run ------------------------------------------------------------------------------

Outcome = tuple[list[dict], list[tuple[str, str]]]  # rows, and (what, error) of each failure


def on_emulated_cluster(script: str, names: list[str], args: argparse.Namespace, layout: Layout,
                        congestion: str | None, each: Callable[[Run], Outcome],
                        ) -> tuple[list[dict], list[tuple[str, str]], Path]:
    """Build hosts ``names`` linked at ``args.rate``, ``args.rtt`` apart (:func:`far_links`),
    and run ``each`` on them; its rows and failures, and the folder of every process's output
    (removed when nothing failed). Exits with status 2 where no emulated cluster can be built
    here or ``--rtt`` names a host the run has not, 130 on Ctrl-C (after the cluster's
    processes and namespaces are gone); SIGTERM and SIGHUP end it the same way."""
    sysctls = dict(w.split("=", 1) for w in getattr(args, "host_sysctl", ()))
    try:
        made = EmulatedCluster(names, rate=args.rate, rtt=args.rtt,
                               force_delay_line=args.delay_line, congestion_control=congestion,
                               sysctls=sysctls)
    except ValueError as error:
        print(f"benchmarks/{script}.py: {error} (hosts: {' '.join(names)})", file=sys.stderr)
        raise SystemExit(2) from None
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda s, _: sys.exit(128 + s))
    logs = Path(tempfile.mkdtemp(prefix=f"gradstar-{script}-"))
    failures: list[tuple[str, str]] = []
    try:
        with made as cluster:
            for host in args.outbound_only:
                cluster.block_inbound(host)
            print(cluster.describe(), file=sys.stderr, flush=True)
            if args.outbound_only:
                print(f"outbound-only (behind NAT): {' '.join(args.outbound_only)}",
                      file=sys.stderr, flush=True)
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
