"""An emulated cluster on one Linux machine: hosts as network namespaces on a bridge, each host's
link rate-limited in both directions.

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

Each host runs the TCP congestion control it is given, by default ``cubic``, Linux's own
default. It is set in every namespace because a new namespace inherits the machine's setting,
and the development VM runs ``bbr``: BBR v1 estimates its bandwidth from delivery samples that
tbf's burst inflates and its RTT floor from a veth with no queue (20 us), and ~every 10 s drops
to 4 packets for 200 ms (ProbeRTT). Measured 2026-11-26, node-local 4x1 64 MiB: 93% of the
link bound under cubic, 82% under bbr, with whole-host stalls of 0.2-0.5 s (veth counters
sampled every 50 ms) and no retransmissions. ``congestion_control=None`` keeps the machine's.

Setting it inside a namespace needs the algorithm in the machine's
``net.ipv4.tcp_allowed_congestion_control`` (a namespace other than the first gets EPERM
otherwise, root or not); a machine that defaults to BBR may list only ``reno bbr``. Building
then adds the algorithm to that list for as long as it sets the hosts' default, and puts the
list back as it found it right after, also on errors (:func:`allowing_congestion_control`). That
is enough: a namespace keeps the default it was given, and its new sockets, connecting or
accepted, take it without the list being consulted again (measured 2026-11-27, kernel 6.18:
``getsockopt(TCP_CONGESTION)`` says ``cubic`` with the list back to ``reno bbr``). So the list
is widened for milliseconds, never for a cluster's life, and two clusters alive at once, in one
process or several, cannot restore each other's change too early: a lock file
(``/run/lock/gradstar-emulated-cluster.lock``, flock, released by the kernel if its holder dies)
lets one build at a time widen and restore it. An algorithm this kernel does not offer at all
(``tcp_available_congestion_control``) fails the build with :class:`ClusterUnavailable`.

What a caller does with it::

    with EmulatedCluster(["node0", "node1"], rate="200mbit") as cluster:
        cluster.address("node1")                       # "10.77.0.2"
        proc = cluster.popen("node1", ["python", "-m", "http.server"])   # runs in node1
        cluster.run("node0", ["curl", "http://node1:8000/"])            # to completion
        cluster.link_bytes()                           # {"node0": LinkBytes(rx, tx), ...}
        cluster.link_down("node1"); cluster.link_up("node1")
        cluster.qdiscs("node1")                        # `tc qdisc show` of both ends

Every process started with :meth:`EmulatedCluster.popen` is stopped (SIGTERM, then SIGKILL) when
the cluster closes, and so is anything else still running in its namespaces; then the
namespaces (which takes their interfaces with them) and the ``/etc/netns`` folders are removed.
A cluster that fails half-way through building removes what it made before it raises. Only a
SIGKILL of the process holding the cluster leaves namespaces behind; their names start with
``gs-`` and a random tag (``ip netns list``).

It needs root, ``ip`` (iproute2) and, to shape links, ``tc``: :func:`unavailable_reason` says
which is missing (or that this system forbids namespaces, or lacks the congestion control),
and building raises :class:`ClusterUnavailable` with that reason. ``tests/cluster`` fails on it
(a cluster test that cannot build its cluster proves nothing, so it must not pass as a skip);
the benchmarks stop on it.

Nothing here imports gradstar: the library must never depend on it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

#: The hosts' /24 unless a cluster is given another.
SUBNET = "10.77.0"
#: Each host's TCP congestion control unless a cluster is given another (see the module).
CONGESTION_CONTROL = "cubic"
#: The token bucket's defaults: BURST bounds the bytes sent at once above RATE (it must hold a
#: GSO packet of 64 KiB), LATENCY how long a packet may wait for tokens before it is dropped.
BURST = "800kbit"
LATENCY = "50ms"
NETNS_ETC = Path("/etc/netns")
_ALLOWED = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
_AVAILABLE = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")
#: One build at a time, across processes, widens and restores the allowed list.
_ALLOWED_LOCK = Path("/run/lock/gradstar-emulated-cluster.lock")
_RUN_TIMEOUT = 20.0
#: Seconds a process gets between SIGTERM and SIGKILL when the cluster closes.
STOP_GRACE = 5.0
_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)$")
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


class ClusterUnavailable(OSError):
    """This machine cannot build an emulated cluster; the message says why."""


@dataclass(frozen=True)
class LinkBytes:
    """Bytes a host's link carried so far, from the host's side: ``rx`` in, ``tx`` out."""

    rx: int
    tx: int

    def __sub__(self, other: LinkBytes) -> LinkBytes:
        return LinkBytes(self.rx - other.rx, self.tx - other.tx)


@dataclass(frozen=True)
class Host:
    """One host: its name, network namespace, address, and bridge port (the far end of its
    ``eth0``)."""

    name: str
    namespace: str
    address: str
    port: str


def rate_bytes_per_second(rate: str) -> float:
    """``tc``'s rate notation in bytes per second: ``200mbit`` -> 25e6 (tc's k, m, g are powers
    of 1000; ``bps`` is bytes per second).

    Raises:
        ValueError: ``rate`` is not a number followed by [kmgt]bit or [kmgt]bps.
    """
    match = _RATE.match(rate.strip().lower())
    if match is None:
        raise ValueError(f"rate {rate!r} is not in tc's notation, e.g. 200mbit or 25mbps")
    value = float(match[1]) * _UNITS[match[2]]
    return value / 8 if match[3] == "bit" else value


def unavailable_reason(shaped: bool = True) -> str | None:
    """Why an emulated cluster cannot be built here, or None if it can (as far as can be told
    without building one: a sandbox may still forbid namespaces, which building reports)."""
    if os.geteuid() != 0:
        return "building network namespaces needs root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    if shaped and shutil.which("tc") is None:
        return "the tc command (iproute2) is missing, and links cannot be shaped without it"
    return None


def congestion_control_reason(name: str) -> str | None:
    """Why hosts cannot run TCP congestion control ``name`` here, or None if they can."""
    available = _AVAILABLE.read_text(encoding="ascii").split()
    if name in available:
        return None
    return (f"this kernel does not offer TCP congestion control {name!r} (available: "
            f"{' '.join(available)}); load its module (modprobe tcp_{name}) or build the "
            f"cluster with congestion_control=None to keep the machine's")


@contextlib.contextmanager
def allowing_congestion_control(name: str) -> Iterator[None]:
    """While the block runs, ``name`` is in the machine's allowed list (added if missing), so
    a namespace may make it its default; after it, the list is what it was, also if the block
    raised. Blocks of all processes on this machine take turns (see the module)."""
    _ALLOWED_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with _ALLOWED_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the kernel drops it when the file closes or we die
        original = _ALLOWED.read_text(encoding="ascii")
        if name in original.split():
            yield
            return
        _ALLOWED.write_text(f"{original.strip()} {name}\n", encoding="ascii")
        try:
            yield
        finally:
            _ALLOWED.write_text(original, encoding="ascii")


def _run(argv: Sequence[str], timeout: float = _RUN_TIMEOUT) -> str:
    return subprocess.run(list(argv), check=True, capture_output=True, text=True,
                          timeout=timeout).stdout


class EmulatedCluster:
    """Hosts ``names`` as network namespaces on one bridge; a context manager (see the module
    docstring). ``rate`` (tc notation, e.g. ``"200mbit"``; None: unshaped) limits every host's
    link each way; ``subnet`` is the first three octets of the hosts' /24, ``first`` the last
    octet of the first host's address.

    Raises:
        ValueError: no hosts, a repeated or unusable name, a bad rate, or too many hosts.
        ClusterUnavailable: not root, no ``ip``/``tc``, a congestion control this kernel does
            not offer, or this system refused to build it.
    """

    def __init__(self, names: Sequence[str], *, rate: str | None = "200mbit",
                 burst: str = BURST, latency: str = LATENCY, subnet: str = SUBNET,
                 first: int = 1, congestion_control: str | None = CONGESTION_CONTROL) -> None:
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
        self.tag = uuid.uuid4().hex[:6]
        self.bridge = f"gs-{self.tag}-br"
        self.hosts: dict[str, Host] = {
            name: Host(name, f"gs-{self.tag}-{name}", f"{subnet}.{first + i}", f"p{i}")
            for i, name in enumerate(names)}
        self._made: list[str] = []  # namespaces, in the order made
        self._etc: list[Path] = []
        self._processes: list[subprocess.Popen] = []
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
        reason = unavailable_reason(shaped=self.rate is not None)
        if reason is None and self.congestion_control is not None:
            reason = congestion_control_reason(self.congestion_control)
        if reason is not None:
            raise ClusterUnavailable(reason)
        try:
            self._build()
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
            ns = host.namespace
            self._add_namespace(ns)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            if self.congestion_control is not None:
                with allowing_congestion_control(self.congestion_control):
                    _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                          f"net.ipv4.tcp_congestion_control={self.congestion_control}"])
            _run(["ip", "-n", self.bridge, "link", "add", host.port, "type", "veth", "peer",
                  "name", "eth0", "netns", ns])
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

    def argv(self, host: str, command: Sequence[str]) -> list[str]:
        """``command`` wrapped to run in ``host`` (``ip netns exec`` execs it: the process
        started is the command itself, with the host's /etc/hosts)."""
        return ["ip", "netns", "exec", self.hosts[host].namespace, *command]

    def popen(self, host: str, command: Sequence[str], *,
              env: Mapping[str, str] | None = None, **kwargs: object) -> subprocess.Popen:
        """Start ``command`` in ``host``; it is stopped when the cluster closes. ``kwargs`` go
        to :class:`subprocess.Popen` (stdin defaults to /dev/null, start_new_session to
        True)."""
        if self._closed:
            raise RuntimeError("the cluster is closed")
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        # Its own session: a Ctrl-C reaches only the caller, which stops it in order.
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.argv(host, command),
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

    def describe(self) -> str:
        where = ", ".join(f"{h.name} {h.address}" for h in self.hosts.values())
        shaped = (f"each link {self.rate} each way (tbf)" if self.rate is not None
                  else "links unshaped")
        tcp = self.congestion_control or "the machine's congestion control"
        return (f"{len(self.hosts)} hosts as network namespaces on a bridge, {shaped}, TCP "
                f"{tcp}: {where}")
