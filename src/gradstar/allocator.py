"""Keep glibc from mapping and unmapping every multi-megabyte buffer.

Each received gRPC message becomes a fresh ``bytes`` object of one chunk (MBs). By default glibc
serves such sizes with mmap and returns them with munmap, so every chunk costs page faults on
first touch (what that cost: docs/performance.md, "Figures behind the code"). Raising the mmap
threshold (and the trim threshold with it) makes glibc reuse heap memory for chunk buffers.
The price is that freed chunk buffers stay in the process instead of going back to the OS, which
is bounded by the chunks in flight.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 64 << 20
TRIM_THRESHOLD = 512 << 20
TOP_PAD = 64 << 20

_done = False


@functools.cache
def _libc() -> ctypes.CDLL:
    """glibc, looked up once: ``ctypes.util.find_library`` runs ``ldconfig`` (a subprocess) on
    every call, which the hub's sweep, trimming from its event loop, paid twice a second.

    Raises:
        OSError: no C library could be loaded.
    """
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def tune_allocator() -> bool:
    """Apply the thresholds once per process on glibc Linux; return whether they were applied."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):  # musl and other libcs have no mallopt
        return False
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (_M_TOP_PAD, TOP_PAD)))
    if not ok:
        logging.getLogger("gradstar").debug("mallopt refused the chunk-buffer thresholds")
    _done = ok
    return ok


_M_ARENA_MAX = -8


def share_malloc_arena() -> bool:
    """Have the threads started from now on (gRPC's) allocate from glibc's main arena, as the
    event loop does; return whether glibc took it (Linux with glibc only). For hub processes
    (``gradstar coordinator``, ``gradstar shard``), never a rank's: a training process's own
    threads may want arenas of their own.

    tune_allocator keeps freed chunk buffers in the heap they came from, which bounds the hub's
    memory by the chunks in flight only if its threads share one heap. By default glibc gives
    each new thread an arena of its own: gRPC's threads then allocate the streams' buffers in
    theirs, the event loop its frames in the main arena, and each arena keeps its own high-water
    mark. Measured with ``benchmarks/broadcast_memory.py`` (512 MiB to a rank 5 s late, stream
    path): the hub grew by 76-89 MiB of which ~40 MiB was live; 50-52 MiB with one arena, and a
    2-rank 64 MiB all_reduce no slower.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):  # musl and other libcs have no mallopt
        return False
    return mallopt(_M_ARENA_MAX, 1) == 1


def trim_heap() -> bool:
    """Hand the heap's free memory back to the system (glibc ``malloc_trim``); return whether
    it could be done. The thresholds above keep freed memory for reuse; after a burst that will
    not come again soon (the hub's pending collectives given back), that memory is trimmed."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(_libc().malloc_trim(0))
    except (OSError, AttributeError):
        return False
