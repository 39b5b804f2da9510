"""Each host's TCP congestion control, and the machine-wide list that lets a namespace pick it.

Each host runs the congestion control it is given, by default ``cubic``, Linux's own default.
It is set in every namespace because a new namespace inherits the machine's setting, and the
development VM runs ``bbr``: BBR v1 estimates its bandwidth from delivery samples that tbf's
burst inflates and its RTT floor from a veth with no queue (20 us), and ~every 10 s drops to 4
packets for 200 ms (ProbeRTT). Measured 2026-11-26, node-local 4x1 64 MiB: 93% of the link
bound under cubic, 82% under bbr, with whole-host stalls of 0.2-0.5 s (veth counters sampled
every 50 ms) and no retransmissions. ``congestion_control=None`` keeps the machine's.

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
(``tcp_available_congestion_control``) fails the build with ``ClusterUnavailable``.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

#: Each host's TCP congestion control unless a cluster is given another (see the module).
CONGESTION_CONTROL = "cubic"
_ALLOWED = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
_AVAILABLE = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")
#: One build at a time, across processes, widens and restores the allowed list.
_ALLOWED_LOCK = Path("/run/lock/gradstar-emulated-cluster.lock")
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
