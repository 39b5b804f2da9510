"""Shared memory between a rank and a hub process on the same host: the collective fast path.

Why: over loopback gRPC every payload byte is copied several times — into a bytes object by
grpc-python, through the kernel's socket buffers on both sides, out of a bytes object again —
and those copies are most of the hub's and the rank's CPU (``PERF-NOTES.md``). When a rank and
its hub (or hub shard) share a host, the rank instead puts its input into a memory segment the
hub maps, and the hub writes the rank's result into the same segment: one copy in and one copy
out on the rank, the reduction reading and writing memory directly on the hub. The Collective
stream still carries the whole protocol (header, accept, end, errors, flow control); only the
chunk payloads move through memory, announced by small frames
(:func:`gradstar.wire.encode_shm_chunk`).

Safety. A segment is a Linux memfd the rank creates with sealing allowed and seals against
shrinking and growing, so a mapping can never lose its pages under the hub (which would kill it
with SIGBUS). The hub opens ``/proc/<pid>/fd/<fd>`` — which the kernel allows only to the same
user (or a privileged one) in the same pid namespace — and attaches only a segment that is a
gradstar memfd, sealed that way, of at least the declared size, whose first bytes are the random
key the header names: only the segment's owner knows the key, so a token holder cannot point the
hub at another rank's segment. Anything else (another host, another user, another container, a
system without memfds) is refused with a reason, and that stream carries its payloads as frames,
exactly as without shared memory.

Layout of a segment: the key in its first page, then the data (``Segment.data``), which the
collective's header describes as an input region at offset 0 and an output region at
``output_offset``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import secrets
import stat
import sys
import threading
import time

#: The data starts one page in; the page before holds the key.
DATA_OFFSET = mmap.PAGESIZE
KEY_BYTES = 16
#: memfd names start with this (visible as /memfd:NAME in /proc), so the hub can tell ours.
NAME = "gradstar-collective"
#: Free segments a process keeps for reuse, at most, and their bytes at most.
POOL_KEEP = 4
POOL_KEEP_BYTES = 1 << 30
#: How often (seconds) an attach also looks for mappings whose owner let go; the hub sweeps on
#: its own timer as well, every half heartbeat interval (see SegmentMapper).
SWEEP_INTERVAL = 10.0

_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0)


def supported() -> bool:
    """Whether this system has sealable memfds (Linux)."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create") and bool(_SEALS)


_HOST_ID: str | None = None


def host_id() -> str:
    """What makes two processes one host for shared memory: the kernel's boot id and the
    network namespace. Processes in different network namespaces of one kernel could map each
    other's segments, but they stand for different hosts (containers, the emulated cluster of
    ``benchmarks/cluster.py``), whose traffic must cross their links; so the hub attaches
    only a segment whose owner's host id equals its own."""
    global _HOST_ID
    if _HOST_ID is None:
        try:
            with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as boot:
                boot_id = boot.read().strip()
            net = os.stat("/proc/self/ns/net").st_ino
        except OSError:
            boot_id, net = "", 0
        _HOST_ID = f"{boot_id}/{net}"
    return _HOST_ID


def host_key() -> str:
    """A short name of :func:`host_id` that ranks and shards announce to the coordinator (a
    digest: the boot id itself stays on the host)."""
    return hashlib.sha256(host_id().encode()).hexdigest()[:16]


class Segment:
    """A rank's sealed memfd segment with ``size`` data bytes, mapped into this process."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.fd = os.memfd_create(NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, DATA_OFFSET + size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS | fcntl.F_SEAL_SEAL)
            self._map = mmap.mmap(self.fd, DATA_OFFSET + size)
        except BaseException:
            os.close(self.fd)
            raise
        self.key = secrets.token_bytes(KEY_BYTES)
        self._map[:KEY_BYTES] = self.key
        self.inode = os.fstat(self.fd).st_ino
        self.data = memoryview(self._map)[DATA_OFFSET:]

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # a view still out: the mapping dies with it
            self.data.release()
            self._map.close()
        os.close(self.fd)


class SegmentPool:
    """Segments for reuse within one process: :meth:`acquire` one of at least ``size`` bytes
    and :meth:`release` it after a clean collective. A segment whose collective did not end
    cleanly is :meth:`discard`-ed instead: the hub might still write into it."""

    def __init__(self, keep: int = POOL_KEEP, keep_bytes: int = POOL_KEEP_BYTES) -> None:
        self.keep = keep
        self.keep_bytes = keep_bytes
        self._free: list[Segment] = []
        self._lock = threading.Lock()  # ranks in threads of one process share the pool

    def acquire(self, size: int) -> Segment:
        with self._lock:
            fitting = [s for s in self._free if s.size >= size]
            if fitting:
                best = min(fitting, key=lambda s: s.size)
                self._free.remove(best)
                return best
        # Round up to 1 MiB so that slightly different sizes reuse one segment.
        return Segment(max(size, 1) + (-max(size, 1) % (1 << 20)))

    def release(self, segment: Segment) -> None:
        with self._lock:
            self._free.append(segment)
            # Over either bound, the oldest go first.
            while self._free and (len(self._free) > self.keep
                                  or sum(s.size for s in self._free) > self.keep_bytes):
                self._free.pop(0).close()

    @property
    def free_bytes(self) -> int:
        return sum(s.size for s in self._free)

    @staticmethod
    def discard(segment: Segment) -> None:
        segment.close()


class ShmRefused(Exception):
    """The hub cannot attach a segment; the reason is sent to the rank, which then streams."""


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` (in this pid namespace) has exited: no such process, or a
    zombie whose parent has not reaped it yet (its descriptors, segments included, are gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read()
    except OSError:
        return True
    # "pid (comm) state ...": comm may hold spaces and parentheses; the state follows the last ")".
    state = fields.rpartition(b")")[2].split()[:1]
    return state in ([b"Z"], [b"X"], [])


class SegmentMapper:
    """The hub's side: attaches ranks' segments, keeping mappings for reuse by (pid, fd, inode).

    A mapping stays while its owner keeps the memfd open at that fd; :meth:`sweep` (which the
    hub runs on a timer, whatever the traffic), :meth:`release` (when a rank's stream ends) and
    every attach from the same process drop mappings whose fd is gone or now names another
    file, so the hub never pins memory a rank has let go. A dropped mapping is unmapped, and
    the descriptor ``mmap`` keeps for it closed, as soon as no collective holds a view of it
    (at once when none does: collectives are freed by reference counting as they end).
    """

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int], tuple[int, mmap.mmap, memoryview]] = {}
        self._swept = time.monotonic()

    def attach(self, pid: int, fd: int, inode: int, size: int, key: bytes) -> memoryview:
        """The data of segment ``(pid, fd)``, checked as the module docstring says.

        Raises:
            ShmRefused: the segment cannot be opened here, or is not what the header says.
        """
        if not supported():
            raise ShmRefused("this hub's system has no sealable memfds")
        if time.monotonic() - self._swept > SWEEP_INTERVAL:
            self.sweep()
        path = f"/proc/{pid}/fd/{fd}"
        cached = self._maps.get((pid, fd))
        if cached is None or self._inode(path) != cached[0]:
            self.release(pid)
            cached = self._maps[(pid, fd)] = self._open(path, inode, size)
        if cached[0] != inode:
            raise ShmRefused(f"{path} is not the segment the header names")
        _, mapping, data = cached
        if len(data) < size:
            raise ShmRefused(f"segment {path} holds {len(data)} bytes, the header says {size}")
        if not secrets.compare_digest(mapping[:KEY_BYTES], key):
            raise ShmRefused(f"segment {path} does not carry the header's key")
        return data[:size]

    @staticmethod
    def _inode(path: str) -> int | None:
        try:
            return os.stat(path).st_ino
        except OSError:
            return None

    @staticmethod
    def _open(path: str, inode: int, size: int) -> tuple[int, mmap.mmap, memoryview]:
        try:
            target = os.readlink(path)
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as error:
            raise ShmRefused(f"cannot open {path}: {error.strerror}") from None
        try:
            info = os.fstat(fd)
            if not target.startswith(f"/memfd:{NAME}") or not stat.S_ISREG(info.st_mode):
                raise ShmRefused(f"{path} is not a gradstar segment")
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if seals & _SEALS != _SEALS:
                raise ShmRefused(f"segment {path} is not sealed against resizing")
            if info.st_ino != inode or info.st_size < DATA_OFFSET + size:
                raise ShmRefused(f"{path} is not the segment the header names")
            mapping = mmap.mmap(fd, info.st_size)
        except OSError as error:
            raise ShmRefused(f"cannot map {path}: {error.strerror}") from None
        finally:
            os.close(fd)
        return info.st_ino, mapping, memoryview(mapping)[DATA_OFFSET:]

    def release(self, pid: int) -> None:
        """Forget ``pid``'s mappings whose fd no longer names the file mapped (all of them once
        the process has exited)."""
        for key in [k for k in self._maps if k[0] == pid]:
            if self._inode(f"/proc/{key[0]}/fd/{key[1]}") != self._maps[key][0]:
                self._forget(key)

    def sweep(self) -> None:
        """Drop every mapping whose owner closed it (or exited)."""
        self._swept = time.monotonic()
        for pid in {k[0] for k in self._maps}:
            self.release(pid)

    def _forget(self, key: tuple[int, int]) -> None:
        # Views still out (a collective not yet over) keep the mapping alive until they go; the
        # mmap object is freed, unmapped and its descriptor closed, with the last of them.
        _, mapping, data = self._maps.pop(key)
        with contextlib.suppress(BufferError):
            data.release()
            mapping.close()

    @property
    def mapped_bytes(self) -> int:
        return sum(len(m) for _, m, _ in self._maps.values())

    @property
    def mapped(self) -> int:
        """Segments mapped for reuse."""
        return len(self._maps)


__all__ = ["DATA_OFFSET", "Segment", "SegmentMapper", "SegmentPool", "ShmRefused", "process_gone",
           "supported"]
