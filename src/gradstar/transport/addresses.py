"""Addresses that other hosts reach: what a hub, a shard or a peer server advertises.

A server that only this host uses listens on 127.0.0.1 and says so. A server that other hosts
use must advertise an address *they* reach, and a host name is a poor guess: on many machines
(Debian's ``/etc/hosts``, containers and network namespaces sharing one UTS name) the name
resolves to 127.0.1.1 or to the asking host itself. What every host already reaches is the
address it reached the coordinator (or torch's store) at, so the default is *this host's
address on the route toward that peer*: the source address the kernel picks for a packet to it
(a UDP ``connect``, which sends nothing). When the peer is this host itself, that is the
address the others use for it too.

Which wins, in :func:`advertised_host`:

1. an explicit host (``GRADSTAR_ADVERTISE_HOST`` / ``--advertise-host``): NAT, DNS names;
2. an interface (``GRADSTAR_SOCKET_IFNAME``, as ``GLOO_SOCKET_IFNAME`` for gloo): its IPv4
   address, for machines with several networks;
3. the route toward the peer the caller names (the coordinator, torch's ``MASTER_ADDR``);
4. this machine's host name, as before, when nothing else is known.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

from gradstar.errors import ConfigurationError

#: ioctl number of SIOCGIFADDR (linux/sockios.h): an interface's IPv4 address.
_SIOCGIFADDR = 0x8915
WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def split_host_port(address: str) -> tuple[str, str]:
    """``("host", "port")`` of ``host:port`` or ``[v6]:port`` (port "" when absent)."""
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        return host, rest.lstrip(":")
    if address.count(":") == 1:
        host, _, port = address.partition(":")
        return host, port
    return address, ""


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (localhost, 127.0.0.0/8, ::1)."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name``.

    Raises:
        ConfigurationError: no such interface, or it has no IPv4 address.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", name.encode()[:15]))
        except OSError as error:
            raise ConfigurationError(
                f"GRADSTAR_SOCKET_IFNAME={name!r}: this host has no interface of that name with "
                f"an IPv4 address ({error.strerror}); name one of "
                f"{', '.join(n for _, n in socket.if_nameindex())}") from None
    return socket.inet_ntoa(packed[20:24])


def route_address(toward: str) -> str | None:
    """This host's source address for packets to ``toward`` (a host name or IP), or None when
    there is no route or the name does not resolve. Sends nothing."""
    try:
        infos = socket.getaddrinfo(toward, 9, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError):
        return None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            try:
                sock.connect(address)
            except OSError:
                continue
            return sock.getsockname()[0]
    return None


def advertised_host(toward: str | None = None, *, advertise: str | None = None,
                    ifname: str | None = None) -> str:
    """The host other hosts should reach this one at (see the module docstring for the order).

    ``toward`` is a peer the other hosts also reach (the coordinator's or the store's host);
    a loopback ``toward`` means every party is on this host: it is returned as it is.

    Raises:
        ConfigurationError: ``ifname`` names no interface with an IPv4 address.
    """
    if advertise:
        return advertise
    if ifname:
        return interface_address(ifname)
    if toward:
        if is_loopback(toward):
            return toward
        found = route_address(toward)
        if found is not None and not is_loopback(found):
            return found
    return socket.gethostname()


def host_port(host: str, port: int | str) -> str:
    """``host:port``, bracketing an IPv6 literal."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


__all__ = ["WILDCARDS", "advertised_host", "host_port", "interface_address", "is_loopback",
           "route_address", "split_host_port"]
