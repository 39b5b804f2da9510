"""The delay line (``delay_line.c``) as a process: its binary, built with gcc on first use, one
line started between two interfaces of a link namespace, and what it reports while it runs.

The binary is cached under ``build/`` beside this file (``.gitignore`` lists ``build/``), named
by a hash of the source and the compiler flags, so an edited source builds afresh and two
processes building at once cannot hand each other half a file (each compiles to a file of its
own and renames it into place); a build removes the binaries of earlier sources.

A :class:`DelayLine` forwards every frame between its ``host`` side and its ``core`` side a
fixed one-way delay later, both ways. Its counters (:class:`DelayLineStats`) come from a file
the program keeps mapped; its CPU from ``/proc/PID/stat``.
"""

from __future__ import annotations

import hashlib
import os
import select
import shutil
import struct
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).resolve().with_name("delay_line.c")
BUILD_DIR = SOURCE.with_name("build")
CFLAGS = ("-O2", "-Wall", "-Wextra", "-Werror")
#: Bytes each direction may hold: above 1 Gbit/s x 200 ms (25 MB), and only touched pages cost.
QUEUE_BYTES = 64 << 20
#: Seconds a line gets to bind its sockets and say "ready".
START_TIMEOUT = 10.0
_MAGIC = 0x676473746c696e31
_DIRECTION = struct.Struct("=8Q")
_HEADER = struct.Struct("=2Q")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class DelayLineError(OSError):
    """The delay line could not be built or started; the message says why."""


def unavailable_reason() -> str | None:
    """Why no delay line can run here (no compiler and no binary built before), or None."""
    if shutil.which("gcc") is None and not _binary_path().is_file():
        return ("gcc is missing, and the delay line (benchmarks/emulated_cluster/delay_line.c) "
                "is compiled on first use: install it (`make test` does, as root: "
                "scripts/ensure_package.sh)")
    return None


def _binary_path() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    return BUILD_DIR / f"delay_line-{digest}"


def binary() -> Path:
    """The compiled delay line, built now if this source was never built here.

    Raises:
        DelayLineError: gcc is missing, or it failed (its messages quoted).
    """
    path = _binary_path()
    if path.is_file():
        return path
    reason = unavailable_reason()
    if reason is not None:
        raise DelayLineError(reason)
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    built = subprocess.run(["gcc", *CFLAGS, "-o", str(partial), str(SOURCE)],
                           capture_output=True, text=True, timeout=120)
    if built.returncode != 0:
        partial.unlink(missing_ok=True)
        raise DelayLineError(f"gcc could not build {SOURCE.name}:\n{built.stderr[-2000:]}")
    os.replace(partial, path)  # atomic: a concurrent build's rename wins, with the same bytes
    for old in BUILD_DIR.glob("delay_line-*"):  # builds of earlier sources (running ones run on)
        if old != path and not old.name.endswith(".partial"):
            old.unlink(missing_ok=True)
    return path


@dataclass(frozen=True)
class DirectionStats:
    """One direction of a line, counted since it started: frames and bytes forwarded, frames
    dropped because its queue was full or the frame too long, failed reads and sends, and the
    bytes queued now and at most."""

    frames: int
    bytes: int
    dropped_full: int
    dropped_oversize: int
    receive_errors: int
    send_errors: int
    queued_bytes: int
    queued_bytes_max: int

    @property
    def lost(self) -> int:
        """Frames this direction did not deliver (send errors include a link taken down)."""
        return self.dropped_full + self.dropped_oversize + self.receive_errors + self.send_errors


@dataclass(frozen=True)
class DelayLineStats:
    """A line's counters: its one-way delay, ``upload`` (host to core) and ``download``."""

    delay_s: float
    upload: DirectionStats
    download: DirectionStats


class DelayLine:
    """One running delay line between interfaces ``host`` and ``core`` of a namespace; start
    it with :meth:`start`. Its owner stops its process (SIGTERM)."""

    def __init__(self, proc: subprocess.Popen, stats_file: Path) -> None:
        self.proc = proc
        self.stats_file = stats_file

    @classmethod
    def start(cls, popen: Callable[..., subprocess.Popen], host: str, core: str,
              one_way_s: float, stats_file: Path, log: Path,
              queue_bytes: int = QUEUE_BYTES) -> DelayLine:
        """Start a line with ``popen(argv, **kwargs)`` (which puts it in its namespace) and
        wait until it has bound both interfaces.

        Raises:
            DelayLineError: it could not be built, or it exited or stayed silent for
                :data:`START_TIMEOUT` s instead of starting (its stderr quoted).
        """
        argv: Sequence[str] = [str(binary()), host, core, str(round(one_way_s * 1e6)),
                               str(stats_file), str(queue_bytes)]
        with log.open("w") as err:
            proc = popen(argv, stdout=subprocess.PIPE, stderr=err)
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT)
        said = proc.stdout.readline() if ready else b""
        proc.stdout.close()  # it says nothing after "ready"
        if said.strip() != b"ready":
            proc.kill()
            proc.wait(timeout=5)
            raise DelayLineError(f"the delay line between {host} and {core} did not start: "
                                 f"{log.read_text(errors='replace')[-1000:] or 'no output'}")
        return cls(proc, stats_file)

    def stats(self) -> DelayLineStats:
        """Its counters now (they stay readable after it exits).

        Raises:
            DelayLineError: the counter file is not the line's (it never started).
        """
        data = self.stats_file.read_bytes()
        magic, delay_ns = _HEADER.unpack_from(data)
        if magic != _MAGIC or len(data) < _HEADER.size + 2 * _DIRECTION.size:
            raise DelayLineError(f"{self.stats_file} holds no delay line's counters")
        upload, download = (DirectionStats(*_DIRECTION.unpack_from(
            data, _HEADER.size + i * _DIRECTION.size)) for i in range(2))
        return DelayLineStats(delay_ns / 1e9, upload, download)

    def cpu_seconds(self) -> float:
        """User plus system CPU seconds it has used so far (0.0 once it is gone)."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime (proc(5))
