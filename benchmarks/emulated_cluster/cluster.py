"""An emulated cluster on one Linux machine: hosts as network namespaces on a bridge, each host's
link rate-limited in both directions and, if asked, as far from the others as a WAN.

:class:`EmulatedCluster` builds H hosts. Each host is a network namespace with one interface,
``eth0``, the inside end of a veth pair whose other end (``pI``) is a port of the bridge ``br0``
in a namespace of its own (so nothing touches the machine's own network); an address on a
private /24 (``SUBNET.1`` upwards); and an ``/etc/netns/NS/hosts`` that resolves every host's
name (``ip netns exec`` mounts it over ``/etc/hosts``), as a cluster's DNS would. (Processes
keep the machine's host name, ``gethostname()``: the hosts share its UTS namespace.) With a
``rate``, each link is limited in BOTH directions by a token bucket::

    tc qdisc add dev eth0 root tbf rate RATE burst BURST latency LATENCY   # in NS: upload
    tc qdisc add dev pI   root tbf rate RATE burst BURST latency LATENCY   # bridge: download

(``tc netem`` is not in every kernel; ``tbf`` is.) Links are full duplex, and the bridge is not a
bottleneck: the time a collective needs on such a cluster is bound by the bytes the busiest host
link carries in one direction, divided by RATE.

Far links (``rtt``). A host given a round trip gets a delay line on its access link: its
``eth0``'s veth peer (``host``) and the bridge port's veth peer (``core``) sit in a third
namespace (``NS_line``), where a delay line (:mod:`.delay_line`, a C program) forwards every
frame between the two after a fixed one-way delay, both ways::

    NS: eth0 (tbf) <-veth-> NS_line: host ==delay line== core <-veth-> bridge: pI (tbf), br0

It forwards Ethernet frames, so TCP runs end to end between the hosts and its windows, slow
start and ACK clocking all see the round trip (a TCP proxy would hide them). The convention:

* ``rtt=MS``: every two hosts are MS apart (each access link carries MS/2 of round trip, MS/4
  each way);
* ``rtt={host: MS}``: MS is that host's round trip to the core (the bridge), so two hosts are
  the sum of theirs apart, and a host left out is at 0: ``{"near0": 5, "near1": 5, "far0": 45,
  "far1": 45}`` puts the near hosts 10 ms apart, near from far 50 ms, the far hosts 90 ms.

A host at 0 has no delay line: exactly the topology above (``force_delay_line=True`` puts a
0 ms line on every link, to measure the line itself). The token buckets stay where they are,
so a frame waits for its rate before or after its delay, never instead of it.

Each host runs the TCP congestion control it is given, by default ``cubic`` (see
:mod:`.congestion`, which also says how a namespace may pick one the machine does not allow).

What a caller does with it::

    with EmulatedCluster(["node0", "node1"], rate="200mbit") as cluster:
        cluster.address("node1")                       # "10.77.0.2"
        proc = cluster.popen("node1", ["python", "-m", "http.server"])   # runs in node1
        cluster.run("node0", ["curl", "http://node1:8000/"])            # to completion
        cluster.link_bytes()                           # {"node0": LinkBytes(rx, tx), ...}
        cluster.link_down("node1"); cluster.link_up("node1")
        cluster.qdiscs("node1")                        # `tc qdisc show` of both ends
    with EmulatedCluster(["a", "b"], rate="200mbit", rtt=50) as far:   # a and b 50 ms apart
        far.delay_line_cpu()                           # {"a": 0.01, "b": 0.01} CPU seconds
        far.delay_line_stats()["a"].upload.lost        # frames the line did not deliver

Every process started with :meth:`EmulatedCluster.popen` is stopped (SIGTERM, then SIGKILL) when
the cluster closes, and so is anything else still running in its namespaces (the delay lines
among them); then the namespaces (which takes their interfaces with them) and the
``/etc/netns`` folders are removed.
A cluster that fails half-way through building removes what it made before it raises. Only a
SIGKILL of the process holding the cluster leaves namespaces behind; their names start with
``gs-`` and a random tag (``ip netns list``), after ``$GRADSTAR_CLUSTER_TAG-`` where that is set
(so that people sharing a machine tell their clusters apart).

It needs root, ``ip`` (iproute2), to shape links ``tc``, and for a delay line gcc (it is
compiled on first use): :func:`unavailable_reason` says which is missing (or that this system
forbids namespaces, or lacks the congestion control), and building raises
:class:`ClusterUnavailable` with that reason. ``tests/cluster`` fails on it (a cluster test
that cannot build its cluster proves nothing, so it must not pass as a skip); the benchmarks
stop on it.

Nothing here imports gradstar: the library must never depend on it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import delay_line
from .congestion import (
    CONGESTION_CONTROL,
    allowing_congestion_control,
    congestion_control_reason,
)
from .delay_line import DelayLine, DelayLineError, DelayLineStats
from .links import LinkBytes, one_way_delays, rate_bytes_per_second
from .outbound import block_inbound

#: The hosts' /24 unless a cluster is given another.
SUBNET = "10.77.0"
#: The token bucket's defaults: BURST bounds the bytes sent at once above RATE (it must hold a
#: GSO packet of 64 KiB), LATENCY how long a packet may wait for tokens before it is dropped.
BURST = "800kbit"
LATENCY = "50ms"
NETNS_ETC = Path("/etc/netns")
_RUN_TIMEOUT = 20.0
#: Seconds a process gets between SIGTERM and SIGKILL when the cluster closes.
STOP_GRACE = 5.0


class ClusterUnavailable(OSError):
    """This machine cannot build an emulated cluster; the message says why."""


@dataclass(frozen=True)
class Host:
    """One host: its name, network namespace, address, bridge port (the far end of its
    ``eth0``), and its access link's one-way delay with the namespace of its delay line (None
    where it has none)."""

    name: str
    namespace: str
    address: str
    port: str
    one_way_s: float = 0.0
    line_namespace: str | None = None


def unavailable_reason(shaped: bool = True, delayed: bool = False) -> str | None:
    """Why an emulated cluster cannot be built here, or None if it can (as far as can be told
    without building one: a sandbox may still forbid namespaces, which building reports)."""
    if os.geteuid() != 0:
        return "building network namespaces needs root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    if shaped and shutil.which("tc") is None:
        return "the tc command (iproute2) is missing, and links cannot be shaped without it"
    return delay_line.unavailable_reason() if delayed else None


def _run(argv: Sequence[str], timeout: float = _RUN_TIMEOUT) -> str:
    return subprocess.run(list(argv), check=True, capture_output=True, text=True,
                          timeout=timeout).stdout


class EmulatedCluster:
    """Hosts ``names`` as network namespaces on one bridge; a context manager (see the module
    docstring). ``rate`` (tc notation, e.g. ``"200mbit"``; None: unshaped) limits every host's
    link each way; ``rtt`` (milliseconds: one number for every pair of hosts, or a map of each
    host's round trip to the core) puts delay lines on the links; ``subnet`` is the first three
    octets of the hosts' /24, ``first`` the last octet of the first host's address;
    ``sysctls`` are set in every host's namespace (``{"net.ipv4.tcp_wmem": "4096 16384
    67108864"}``: a host tuned for far links, as a deployment may tune its own).

    Raises:
        ValueError: no hosts, a repeated or unusable name, a bad rate or round trip, or too
            many hosts.
        ClusterUnavailable: not root, no ``ip``/``tc``, no gcc for a delay line, a congestion
            control this kernel does not offer, or this system refused to build it.
    """

    def __init__(self, names: Sequence[str], *, rate: str | None = "200mbit",
                 rtt: float | Mapping[str, float] | None = None, force_delay_line: bool = False,
                 burst: str = BURST, latency: str = LATENCY, subnet: str = SUBNET,
                 first: int = 1, congestion_control: str | None = CONGESTION_CONTROL,
                 sysctls: Mapping[str, str] | None = None) -> None:
        names = list(names)
        if not names or len(set(names)) != len(names):
            raise ValueError(f"host names must be distinct and at least one: {names}")
        if not all(re.fullmatch(r"[a-z][a-z0-9-]*", n) for n in names):
            raise ValueError(f"host names must be lowercase letters, digits and '-': {names}")
        if first < 1 or first + len(names) > 255:
            raise ValueError(f"{len(names)} hosts from .{first} do not fit in {subnet}.0/24")
        if rate is not None:
            rate_bytes_per_second(rate)  # a bad rate fails here, not half-way through tc
        self.rate, self.burst, self.latency = rate, burst, latency
        self.congestion_control = congestion_control
        self.sysctls = dict(sysctls or {})
        delays = one_way_delays(names, rtt)
        self.rtt = rtt
        # GRADSTAR_CLUSTER_TAG names whose clusters these are (several people share a
        # machine): its namespaces are then gs-TAG-<random>-*, else gs-<random>-*.
        owner = os.environ.get("GRADSTAR_CLUSTER_TAG", "")
        if owner and not re.fullmatch(r"[a-z0-9]{1,4}", owner):
            raise ValueError(f"GRADSTAR_CLUSTER_TAG must be 1-4 lowercase letters or digits: "
                             f"{owner!r}")
        self.tag = f"{owner}-{uuid.uuid4().hex[:4]}" if owner else uuid.uuid4().hex[:6]
        self.bridge = f"gs-{self.tag}-br"
        # "_line" cannot end a host name, so no host's namespace is another's line namespace.
        self.hosts: dict[str, Host] = {
            name: Host(name, f"gs-{self.tag}-{name}", f"{subnet}.{first + i}", f"p{i}",
                       delays[name], f"gs-{self.tag}-{name}_line"
                       if delays[name] > 0 or force_delay_line else None)
            for i, name in enumerate(names)}
        self._made: list[str] = []  # namespaces, in the order made
        self._etc: list[Path] = []
        self._processes: list[subprocess.Popen] = []
        self._lines: dict[str, DelayLine] = {}
        self._line_dir: Path | None = None  # the lines' counter files and logs
        self._closed = False

    # -- building and removing -----------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        self.build()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def build(self) -> None:
        """Make the bridge and the hosts; on any failure remove what was made, then raise.

        Raises:
            ClusterUnavailable: see the class.
        """
        reason = unavailable_reason(shaped=self.rate is not None, delayed=any(
            h.line_namespace for h in self.hosts.values()))
        if reason is None and self.congestion_control is not None:
            reason = congestion_control_reason(self.congestion_control)
        if reason is not None:
            raise ClusterUnavailable(reason)
        try:
            self._build()
        except DelayLineError as error:
            self.close()
            raise ClusterUnavailable(f"no delay line: {error}") from error
        except (OSError, subprocess.SubprocessError) as error:
            self.close()
            detail = (getattr(error, "stderr", None) or str(error)).strip()
            raise ClusterUnavailable(f"building network namespaces failed: {detail[:300]}") \
                from error
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        self._add_namespace(self.bridge)
        _run(["ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.bridge, "link", "set", "br0", "up"])
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{h.address} {h.name}\n" for h in self.hosts.values())
        for host in self.hosts.values():
            self._build_host(host, hosts_file)

    def _build_host(self, host: Host, hosts_file: str) -> None:
        ns = host.namespace
        self._add_namespace(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        for key, value in self.sysctls.items():  # per namespace, as a tuned host's own
            _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{key}={value}"])
        if self.congestion_control is not None:
            with allowing_congestion_control(self.congestion_control):
                _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                      f"net.ipv4.tcp_congestion_control={self.congestion_control}"])
        if host.line_namespace is None:
            _run(["ip", "-n", self.bridge, "link", "add", host.port, "type", "veth", "peer",
                  "name", "eth0", "netns", ns])
        else:
            self._build_line(host)
        _run(["ip", "-n", self.bridge, "link", "set", host.port, "master", "br0"])
        _run(["ip", "-n", self.bridge, "link", "set", host.port, "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        if self.rate is not None:
            for where, dev in ((ns, "eth0"), (self.bridge, host.port)):
                _run(["tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                      self.rate, "burst", self.burst, "latency", self.latency])
        folder = NETNS_ETC / ns
        folder.mkdir(parents=True, exist_ok=True)
        self._etc.append(folder)
        (folder / "hosts").write_text(hosts_file, encoding="ascii")

    def _build_line(self, host: Host) -> None:
        """Host ``host``'s eth0 and bridge port, each a veth whose peer is in its line
        namespace, and the delay line between the peers, started."""
        line = host.line_namespace
        self._add_namespace(line)
        # No IPv6 on the line's own interfaces: their router solicitations would cross the
        # line into the cluster as traffic no host sent.
        _run(["ip", "netns", "exec", line, "sysctl", "-q", "-w",
              "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"])
        _run(["ip", "-n", line, "link", "add", "host", "type", "veth", "peer", "name", "eth0",
              "netns", host.namespace])
        _run(["ip", "-n", self.bridge, "link", "add", host.port, "type", "veth", "peer",
              "name", "core", "netns", line])
        for dev in ("host", "core"):
            _run(["ip", "-n", line, "link", "set", dev, "up"])
        if self._line_dir is None:
            self._line_dir = Path(tempfile.mkdtemp(prefix=f"gs-{self.tag}-lines-"))
        started = DelayLine.start(
            lambda argv, **kwargs: self.popen_in(line, argv, **kwargs), "host", "core",
            host.one_way_s, self._line_dir / f"{host.name}.stats",
            self._line_dir / f"{host.name}.log")
        self._lines[host.name] = started

    def _add_namespace(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._made.append(ns)

    def close(self) -> None:
        """Stop every process started in the cluster and remove the namespaces and their
        /etc/netns folders. Idempotent; never raises for a part already gone."""
        if self._closed:
            return
        self._closed = True
        self.stop_processes(self._processes)
        if self._line_dir is not None:
            shutil.rmtree(self._line_dir, ignore_errors=True)
        for ns in reversed(self._made):
            self._kill_namespace_pids(ns)
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                _run(["ip", "netns", "del", ns])  # also deletes the interfaces inside it
        for folder in self._etc:
            shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            NETNS_ETC.rmdir()  # only if no other namespace uses it

    @staticmethod
    def _kill_namespace_pids(ns: str) -> None:
        """SIGKILL whatever still runs in ``ns``: only what this cluster started can."""
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            for pid in _run(["ip", "netns", "pids", ns]).split():
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)

    # -- running things in a host --------------------------------------------------------------

    def address(self, host: str) -> str:
        return self.hosts[host].address

    def block_inbound(self, host: str) -> None:
        """Make ``host`` outbound-only, as behind NAT (:mod:`.outbound`): new inbound TCP on
        its link is dropped, what it dials is answered.

        Raises:
            ClusterUnavailable: nftables is missing or refused the rules.
        """
        block_inbound(lambda command: self.argv(host, command), host, ClusterUnavailable)

    def argv(self, host: str, command: Sequence[str]) -> list[str]:
        """``command`` wrapped to run in ``host`` (``ip netns exec`` execs it: the process
        started is the command itself, with the host's /etc/hosts)."""
        return ["ip", "netns", "exec", self.hosts[host].namespace, *command]

    def popen(self, host: str, command: Sequence[str], *,
              env: Mapping[str, str] | None = None, **kwargs: object) -> subprocess.Popen:
        """Start ``command`` in ``host``; it is stopped when the cluster closes. ``kwargs`` go
        to :class:`subprocess.Popen` (stdin defaults to /dev/null, start_new_session to
        True)."""
        return self.popen_in(self.hosts[host].namespace, command, env=env, **kwargs)

    def popen_in(self, namespace: str, command: Sequence[str], *,
                 env: Mapping[str, str] | None = None, **kwargs: object) -> subprocess.Popen:
        """:meth:`popen` in any of the cluster's namespaces (a host's, the bridge's, a
        line's)."""
        if self._closed:
            raise RuntimeError("the cluster is closed")
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        # Its own session: a Ctrl-C reaches only the caller, which stops it in order.
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(["ip", "netns", "exec", namespace, *command],
                                env=None if env is None else dict(env), **kwargs)
        self._processes.append(proc)
        return proc

    def run(self, host: str, command: Sequence[str], *, timeout: float = 60.0,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run ``command`` in ``host`` to completion (killed after ``timeout`` s, then raises
        :class:`subprocess.TimeoutExpired`); its output is captured as text."""
        return subprocess.run(self.argv(host, command), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL,
                              env=None if env is None else dict(env))

    @staticmethod
    def stop_processes(processes: Sequence[subprocess.Popen],
                       grace: float = STOP_GRACE) -> None:
        """SIGTERM each of ``processes`` still running, wait up to ``grace`` s for all, SIGKILL
        those left, and reap them."""
        live = [p for p in processes if p.poll() is None]
        for proc in live:
            with contextlib.suppress(OSError):
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in live:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)

    # -- observing and breaking links ----------------------------------------------------------

    def link_bytes(self) -> dict[str, LinkBytes]:
        """Each host's link's bytes so far (its eth0's view: what its bridge port sent is what
        the host received), read in one call from the bridge's namespace."""
        listed = json.loads(_run(["ip", "-n", self.bridge, "-s", "-j", "link", "show"]))
        ports = {entry["ifname"]: entry["stats64"] for entry in listed if "stats64" in entry}
        return {name: LinkBytes(rx=ports[h.port]["tx"]["bytes"], tx=ports[h.port]["rx"]["bytes"])
                for name, h in self.hosts.items()}

    def link_down(self, host: str) -> None:
        """Take ``host``'s link down (its eth0), as a pulled cable or a dead switch port."""
        _run(["ip", "-n", self.hosts[host].namespace, "link", "set", "eth0", "down"])

    def link_up(self, host: str) -> None:
        _run(["ip", "-n", self.hosts[host].namespace, "link", "set", "eth0", "up"])

    def qdiscs(self, host: str) -> dict[str, str]:
        """``tc qdisc show`` of ``host``'s link: ``upload`` (its eth0) and ``download`` (its
        bridge port)."""
        h = self.hosts[host]
        return {"upload": _run(["tc", "-n", h.namespace, "qdisc", "show", "dev", "eth0"]),
                "download": _run(["tc", "-n", self.bridge, "qdisc", "show", "dev", h.port])}

    # -- the delay lines -----------------------------------------------------------------------

    def delay_line_cpu(self) -> dict[str, float]:
        """CPU seconds (user + system) each host's delay line has used so far; hosts without
        one are left out."""
        return {name: line.cpu_seconds() for name, line in self._lines.items()}

    def delay_line_stats(self) -> dict[str, DelayLineStats]:
        """Each host's delay line's counters so far (:class:`DelayLineStats`); hosts without
        one are left out."""
        return {name: line.stats() for name, line in self._lines.items()}

    def describe(self) -> str:
        def far(h: Host) -> str:
            return f" ({h.one_way_s * 2e3:g} ms to the core)" if h.line_namespace else ""

        where = ", ".join(f"{h.name} {h.address}{far(h)}" for h in self.hosts.values())
        shaped = (f"each link {self.rate} each way (tbf)" if self.rate is not None
                  else "links unshaped")
        tcp = self.congestion_control or "the machine's congestion control"
        lines = (f", delay lines on {len(self._lines)} links" if self._lines else "")
        return (f"{len(self.hosts)} hosts as network namespaces on a bridge, {shaped}{lines}, "
                f"TCP {tcp}: {where}")
