"""A compose-like network made of Linux network namespaces, for running services as processes.

:func:`service_network` gives each named service its own network namespace with one interface
``eth0`` on a private bridge (itself in a namespace of its own, so nothing touches the host's
network), an address in 10.213.0.0/24, and an ``/etc/hosts`` (through ``/etc/netns/NAME/``,
which ``ip netns exec`` mounts) that resolves every service name, as compose's network DNS
does. Where namespaces cannot be made (not root, no ``ip``, a sandbox that forbids them) it
yields a loopback network instead and says why; the caller adapts its addresses.
Everything created is removed when the context exits.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.213.0"


@dataclass
class ServiceNetwork:
    """Where each service runs: ``argv(service, cmd)`` wraps a command to run inside it."""

    kind: str  # "netns" or "loopback"
    reason: str
    addresses: dict[str, str] = field(default_factory=dict)
    namespaces: dict[str, str] = field(default_factory=dict)

    def argv(self, service: str, command: list[str]) -> list[str]:
        if self.kind == "netns":
            return ["ip", "netns", "exec", self.namespaces[service], *command]
        return list(command)

    def describe(self) -> str:
        if self.kind == "netns":
            where = ", ".join(f"{s} {a}" for s, a in self.addresses.items())
            return f"network namespaces on a bridge ({where})"
        return f"loopback, because {self.reason}"

    def interface_bytes(self, service: str) -> tuple[int, int]:
        """(received, sent) bytes of the service's eth0 (netns only)."""
        base = ["ip", "netns", "exec", self.namespaces[service], "cat"]
        stats = "/sys/class/net/eth0/statistics/"
        rx, tx = (int(_run([*base, stats + name]).stdout) for name in ("rx_bytes", "tx_bytes"))
        return rx, tx


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=20)


@contextlib.contextmanager
def service_network(services: list[str]) -> Iterator[ServiceNetwork]:
    tag = uuid.uuid4().hex[:6]
    bridge_ns = f"gs-{tag}-net"
    made: list[str] = []
    hosts_dirs: list[Path] = []
    try:
        network = _build(services, tag, bridge_ns, made, hosts_dirs)
    except (OSError, subprocess.SubprocessError) as error:
        _remove(made, hosts_dirs)
        made, hosts_dirs = [], []
        detail = getattr(error, "stderr", "") or str(error)
        network = ServiceNetwork("loopback", f"network namespaces are not available here "
                                             f"({detail.strip()[:200]})")
    try:
        yield network
    finally:
        _remove(made, hosts_dirs)


def _build(services: list[str], tag: str, bridge_ns: str, made: list[str],
           hosts_dirs: list[Path]) -> ServiceNetwork:
    if os.geteuid() != 0:
        raise OSError("not running as root")
    if shutil.which("ip") is None:
        raise OSError("the ip command (iproute2) is missing")
    _run(["ip", "netns", "add", bridge_ns])
    made.append(bridge_ns)
    _run(["ip", "-n", bridge_ns, "link", "add", "br0", "type", "bridge"])
    _run(["ip", "-n", bridge_ns, "link", "set", "br0", "up"])
    network = ServiceNetwork("netns", "")
    for index, service in enumerate(services):
        network.addresses[service] = f"{SUBNET}.{index + 2}"
        network.namespaces[service] = f"gs-{tag}-{service}"
    hosts = "127.0.0.1 localhost\n" + "".join(
        f"{address} {service}\n" for service, address in network.addresses.items())
    for index, service in enumerate(services):
        ns = network.namespaces[service]
        _run(["ip", "netns", "add", ns])
        made.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        port = f"p{index}"  # the bridge end, named inside the bridge's own namespace
        _run(["ip", "-n", bridge_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0",
              "netns", ns])
        _run(["ip", "-n", bridge_ns, "link", "set", port, "master", "br0"])
        _run(["ip", "-n", bridge_ns, "link", "set", port, "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{network.addresses[service]}/24", "dev", "eth0"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        folder = Path("/etc/netns") / ns
        folder.mkdir(parents=True, exist_ok=True)
        hosts_dirs.append(folder)
        (folder / "hosts").write_text(hosts, encoding="ascii")
    return network


def _remove(namespaces: list[str], hosts_dirs: list[Path]) -> None:
    for ns in reversed(namespaces):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            _run(["ip", "netns", "del", ns])  # also deletes the interfaces inside it
    for folder in hosts_dirs:
        shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        Path("/etc/netns").rmdir()  # only if nothing else uses it
