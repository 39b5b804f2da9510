"""Shared machinery for the scripts in ``benchmarks/``.

* :class:`CoordinatorProcess` runs ``python -m gradstar coordinator --host 127.0.0.1 --port 0
  [--shards K]`` as a subprocess (as in a real deployment), parses the ``gradstar coordinator
  listening on HOST:PORT`` line (printed once all K shards registered), measures the CPU of the
  whole hub (the coordinator and its shard processes, from /proc), and stops it with SIGTERM (then
  SIGKILL, shards included) however the benchmark ends.
* :class:`DriverSync` holds the ranks at chosen points of their loop until this process has acted
  (for instance sampled the hub's CPU right before and after the timed iterations).
* :func:`run_ranks` runs ``target(rank, world_size, *args)`` in ``world_size`` spawned processes
  and collects one result per rank, with a hard deadline: a rank that raises, dies or does not
  report in time makes it raise :class:`RankFailure`, and every child is killed before it returns.
* :func:`run_configs` runs named configurations one after the other, collecting failures.
* Data paths (:data:`PATHS`): a gradstar configuration runs on the same-host shared-memory fast
  path (``shm``) or on the gRPC stream (``stream``), chosen with ``GRADSTAR_SHARED_MEMORY`` in
  the environment of both the coordinator and the ranks (:func:`path_env`, the ``env`` of
  :class:`CoordinatorProcess` and :func:`run_ranks`); each rank reports what its group used
  (:func:`shm_report`) and :func:`check_path` fails a configuration whose ranks did not take the
  path it is labelled with. :func:`add_paths_argument`: the ``--paths`` option.
* :func:`add_run_arguments`, :func:`write_json`: the ``--timeout`` / ``--json`` options every
  script shares.
* :func:`free_port`, :func:`median`, :func:`format_table`, :func:`cpu_seconds_of`: small
  helpers.

Every wait here is bounded; nothing can hang a benchmark run.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import multiprocessing as mp
import os
import queue
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

MiB = 1 << 20

_LISTENING = re.compile(r"gradstar coordinator listening on (\S+):(\d+)")


class BenchmarkError(RuntimeError):
    """A configuration of a benchmark failed; the message says which and why."""


class RankFailure(BenchmarkError):
    """One or more rank processes raised, died or timed out."""


# -- processes we started, killed at interpreter exit if still alive --------------------------

_LIVE: set = set()


def _kill_leftovers() -> None:
    for proc in list(_LIVE):
        _kill(proc)


atexit.register(_kill_leftovers)


def _kill(proc) -> None:
    """Kill a ``subprocess.Popen`` or ``multiprocessing.Process`` and reap it (bounded)."""
    try:
        if isinstance(proc, subprocess.Popen):
            # A coordinator's shards are its children: they must not outlive it.
            below = {pid: f[19] for pid in descendants(proc.pid) if (f := _stat_fields(pid))}
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            _kill_orphans(below, grace=2.0)
        else:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
    except Exception:  # best effort: never mask the original error
        pass
    _LIVE.discard(proc)


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except Exception:
        return None


# Resolved here, in the parent, so the forked coordinator child only has to call it (no dlopen
# between fork and exec, which could deadlock on a lock held by another thread).
_PRCTL = _load_prctl()


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (even by SIGKILL), so a
    killed benchmark leaves no coordinator or rank behind. A no-op elsewhere."""
    if _PRCTL is not None:
        try:
            _PRCTL(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except Exception:
            pass


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for torch.distributed's tcp:// rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def loadavg() -> list[float] | None:
    """1/5/15-minute load averages: other work on the machine skews every figure measured."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


# -- /proc: CPU time of a process tree (Linux) ---------------------------------------------------

try:
    _CLK_TCK = os.sysconf("SC_CLK_TCK")
except (AttributeError, ValueError, OSError):
    _CLK_TCK = 100


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` after the command name: [0] is field 3 (state), [1] ppid, [11] utime,
    [12] stime, [13] cutime, [14] cstime, [19] starttime (see proc(5)). None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, grandchildren, ...), found by scanning the
    ppid field of /proc/*/stat (works without CONFIG_PROC_CHILDREN). Empty off Linux."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        fields = _stat_fields(int(name))
        if fields is not None and len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _cpu_of(fields: list[str]) -> float:
    """utime + stime of the process (all its threads) + cutime + cstime (its children that
    exited and were reaped, e.g. a shard that was restarted), in seconds."""
    return sum(int(v) for v in fields[11:15]) / _CLK_TCK


def cpu_seconds_of(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far, with its reaped children's (Linux
    /proc); None once it is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else _cpu_of(fields)


# -- coordinator subprocess --------------------------------------------------------------------


class CoordinatorProcess:
    """``gradstar coordinator`` in a subprocess on 127.0.0.1 and a free port.

    Use as a context manager::

        with CoordinatorProcess(shards=2) as coord:
            coord.address            # "127.0.0.1:PORT"
            coord.cpu_seconds()      # user+system CPU the hub has used so far (Linux)

    ``shards``: passed as ``--shards K`` (0: the single in-process hub; None: the coordinator's
    own default, ``GRADSTAR_SHARDS`` or ``auto``, which depends on the machine's core count).
    ``env``: variables set for the coordinator on top of this process's environment (its local
    shards inherit them).

    Its stdout and stderr go to a log file (``coord.log_path``); :meth:`log_tail` shows the end of
    it for error reports. ``stop()`` sends SIGTERM, waits ``stop_timeout`` seconds, then SIGKILLs.
    """

    def __init__(self, *, host: str = "127.0.0.1", shards: int | None = None,
                 extra_args: Sequence[str] = (), start_timeout: float = 30.0,
                 stop_timeout: float = 15.0, log_level: str = "WARNING",
                 python: str = sys.executable, env: Mapping[str, str] | None = None) -> None:
        self.host = host
        self.env = dict(env or {})
        self.shards = shards
        self.extra_args = list(extra_args)
        if shards is not None:
            self.extra_args += ["--shards", str(shards)]
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.log_level = log_level
        self.python = python
        self.address: str | None = None
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self._lines: deque[str] = deque(maxlen=200)
        self._reader: threading.Thread | None = None
        self._log_file = None

    def start(self) -> str:
        fd, name = tempfile.mkstemp(prefix="gradstar-coordinator-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        self._log_file = open(self.log_path, "w", buffering=1)
        cmd = [self.python, "-u", "-m", "gradstar", "coordinator", "--host", self.host,
               "--port", "0", "--log-level", self.log_level, *self.extra_args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, bufsize=1,
                                     env=os.environ | self.env, preexec_fn=_die_with_parent)
        _LIVE.add(self.proc)
        found: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(found,), daemon=True,
                                        name="coordinator-log")
        self._reader.start()
        try:
            address = found.get(timeout=self.start_timeout)
        except queue.Empty:
            self.stop()
            raise BenchmarkError(
                f"the coordinator did not print its address within {self.start_timeout:g} s "
                f"(exit code {self.proc.returncode}); log tail:\n{self.log_tail()}"
            ) from None
        if not address:
            self.stop()
            raise BenchmarkError(
                f"the coordinator exited before listening (exit code {self.proc.returncode}); "
                f"log tail:\n{self.log_tail()}"
            )
        self.address = address
        return address

    def _read(self, found: queue.Queue) -> None:
        announced = False
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:  # ends at EOF, i.e. when the coordinator exits
            self._lines.append(line.rstrip("\n"))
            self._log_file.write(line)
            if not announced:
                m = _LISTENING.search(line)
                if m:
                    host = m.group(1)
                    if host in ("0.0.0.0", "::", ""):
                        host = "127.0.0.1"
                    found.put(f"{host}:{m.group(2)}")
                    announced = True
        if not announced:
            found.put("")  # exited without listening

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cpu_sample(self) -> dict | None:
        """The hub's CPU so far (Linux /proc), or None: ``coordinator_s`` (the coordinator process,
        all threads, plus any children it reaped), ``shards_s`` (the live processes below it:
        the shards, with whatever they reaped), ``total_s`` (both) and ``shard_pids`` (pid ->
        start time, to tell a restarted shard). Without shards (``--shards 0``) ``total_s`` is
        the coordinator's own user+system time, as before."""
        if not self.alive():
            return None
        fields = _stat_fields(self.proc.pid)
        if fields is None:
            return None
        try:
            own = _cpu_of(fields)
            shards, pids = 0.0, {}
            for pid in descendants(self.proc.pid):
                child = _stat_fields(pid)
                if child is None:  # exited in between: its time moves to its parent's cutime
                    continue
                shards += _cpu_of(child)
                pids[pid] = child[19]
        except (ValueError, IndexError):
            return None
        return {"coordinator_s": own, "shards_s": shards, "total_s": own + shards,
                "shard_pids": pids}

    def cpu_seconds(self) -> float | None:
        """User + system CPU seconds the hub has used: the coordinator process plus all its child
        processes (the shards), from Linux /proc; else None."""
        sample = self.cpu_sample()
        return None if sample is None else sample["total_s"]

    def shm_mappings(self) -> int | None:
        """How many ranks' shared-memory segments the hub (the coordinator and its shards) has
        mapped now, counted in /proc/PID/maps; None off Linux or once it exited. The hub keeps
        a mapping while its rank holds the segment, so while the ranks are alive this is the
        hub's own proof that they used the shared-memory path."""
        from gradstar.transport.shm import NAME

        if not self.alive():
            return None
        found = 0
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            try:
                maps = Path(f"/proc/{pid}/maps").read_text()
            except OSError:  # exited in between, or not Linux
                continue
            # One segment can span several lines of maps: count distinct (device, inode).
            found += len({tuple(line.split()[3:5]) for line in maps.splitlines()
                          if f"/memfd:{NAME}" in line})
        return found

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(list(self._lines)[-lines:]) or "(empty)"

    def stop(self) -> int | None:
        """SIGTERM, bounded wait, SIGKILL. Returns the exit code. Idempotent."""
        proc = self.proc
        if proc is None:
            return None
        # The shards are the coordinator's children; if it has to be killed they would outlive it.
        below = {pid: f[19] for pid in descendants(proc.pid) if (f := _stat_fields(pid))}
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self._lines.append(f"(did not exit {self.stop_timeout:g} s after SIGTERM: killed)")
                proc.kill()
                proc.wait(timeout=10)
            except Exception:
                _kill(proc)
        _LIVE.discard(proc)
        leftovers = _kill_orphans(below, grace=min(5.0, self.stop_timeout))
        if leftovers:
            self._lines.append(f"(processes {leftovers} of the hub outlived it: killed)")
        if self._reader is not None:
            self._reader.join(timeout=5)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return proc.returncode

    def __enter__(self) -> CoordinatorProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _same_process(pid: int, starttime: str) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z" and fields[19] == starttime


def _kill_orphans(processes: dict[int, str], grace: float) -> list[int]:
    """SIGTERM, then after ``grace`` s SIGKILL, each of ``processes`` (pid -> start time, so a
    recycled pid is left alone) still running. Returns the pids that were still running."""
    alive = [pid for pid, start in processes.items() if _same_process(pid, start)]
    for pid in alive:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_same_process(p, processes[p]) for p in alive):
        time.sleep(0.1)
    for pid in alive:
        if _same_process(pid, processes[pid]):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    return alive


# -- driver/rank synchronisation -----------------------------------------------------------------


class SyncPoints:
    """The ranks' side of :class:`DriverSync` (passed to them as an argument)."""

    def __init__(self, arrived: list, go: list, timeout: float) -> None:
        self.arrived = arrived
        self.go = go
        self.timeout = timeout

    def reach(self, point: int) -> None:
        """Tell the driver this rank is at ``point`` and wait (bounded) until it has acted."""
        self.arrived[point].release()
        if not self.go[point].wait(self.timeout):
            raise TimeoutError(f"the benchmark driver did not release sync point {point} within "
                               f"{self.timeout:g} s")


class DriverSync:
    """Points in the ranks' code where every rank waits until this process has run
    ``action(point)``, e.g. sampled the hub's CPU right before and after the timed loop::

        with DriverSync(world_size, 2, action, timeout=60) as sync:
            run_ranks(target, world_size, (..., sync.handle), timeout=...)
        # in target: sync.reach(0); timed loop; sync.reach(1)

    Every wait is bounded: the driver's thread gives up (and releases every point, so no rank stays
    blocked) ``timeout`` s after it starts, or when the ``with`` block ends; a rank waits at most
    ``timeout`` + 10 s per point. ``errors`` then says what went wrong; the points passed are in
    ``done``.
    """

    def __init__(self, world_size: int, points: int, action: Callable[[int], None],
                 timeout: float) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.action = action
        self.timeout = timeout
        self.handle = SyncPoints([ctx.Semaphore(0) for _ in range(points)],
                                 [ctx.Event() for _ in range(points)],
                                 timeout + 10.0)  # the driver gives up (and releases) first
        self.done: list[int] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="driver-sync")

    def _run(self) -> None:
        deadline = time.monotonic() + self.timeout
        try:
            for point, (arrived, go) in enumerate(zip(self.handle.arrived, self.handle.go,
                                                      strict=True)):
                count = 0
                while count < self.world_size:
                    if self._stop.is_set():
                        return
                    if time.monotonic() >= deadline:
                        self.errors.append(f"only {count} of {self.world_size} ranks reached sync "
                                           f"point {point} within {self.timeout:g} s")
                        return
                    if arrived.acquire(timeout=0.2):
                        count += 1
                try:
                    self.action(point)
                except Exception as error:  # reported, and the ranks still go on
                    self.errors.append(f"sync point {point}: {type(error).__name__}: {error}")
                self.done.append(point)
                go.set()
        finally:
            for go in self.handle.go:  # never leave a rank waiting
                go.set()

    def __enter__(self) -> DriverSync:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# -- rank processes ----------------------------------------------------------------------------


def _rank_entry(target: Callable, rank: int, world_size: int, args: tuple, results,
                parent: int, env: dict[str, str]) -> None:
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
    os.environ.update(env)  # before the target creates its process group, which reads it
    try:
        value = target(rank, world_size, *args)
    except BaseException as error:  # reported to the parent, which raises RankFailure
        results.put((rank, False, f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
        return
    results.put((rank, True, value))


def run_ranks(target: Callable, world_size: int, args: tuple = (), *, timeout: float,
              label: str = "", grace: float = 15.0,
              env: Mapping[str, str] | None = None) -> list:
    """Run ``target(rank, world_size, *args)`` in ``world_size`` spawned processes, with
    ``env`` added to their environment.

    ``target`` must be a module-level function and return something picklable. Returns the
    results indexed by rank. Raises :class:`RankFailure` (after killing every child) if a rank
    raises, exits without reporting, or the ranks have not all reported ``timeout`` seconds
    after start. ``label`` names the configuration in error messages.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    parent = os.getpid()
    procs = [ctx.Process(target=_rank_entry, name=f"rank{r}", daemon=True,
                         args=(target, r, world_size, args, results, parent,
                               dict(env or {})))
             for r in range(world_size)]
    what = f"[{label}] " if label else ""
    reports: dict[int, tuple[bool, object]] = {}
    start = time.monotonic()
    deadline = start + timeout
    try:
        for p in procs:
            p.start()
            _LIVE.add(p)
        dead_since: float | None = None
        while len(reports) < world_size:
            now = time.monotonic()
            if now >= deadline:
                missing = sorted(set(range(world_size)) - set(reports))
                failed = sorted(r for r, (ok, _) in reports.items() if not ok)
                why = (f"ranks {failed} failed; ranks {missing} had not reported {grace:g} s "
                       "later" if failed else
                       f"timed out after {timeout:g} s; ranks {missing} never reported")
                raise RankFailure(
                    f"{what}{why} (still alive: {[r for r in missing if procs[r].is_alive()]}; "
                    f"killed after {now - start:.1f} s)" + _errors_of(reports)
                )
            try:
                rank, ok, value = results.get(timeout=min(1.0, deadline - now))
                reports[rank] = (ok, value)
                if not ok:
                    # One rank failed: give the others a moment to report their own view (for
                    # instance the hub's error naming the lost rank), then stop.
                    deadline = min(deadline, time.monotonic() + grace)
                continue
            except queue.Empty:
                pass
            # A rank that died without reporting (segfault, OOM kill, os._exit).
            dead = [r for r, p in enumerate(procs)
                    if r not in reports and p.exitcode is not None]
            if dead:
                # Its report may still be in the pipe: wait a little before declaring it lost.
                dead_since = dead_since or time.monotonic()
                if time.monotonic() - dead_since > 3.0:
                    raise RankFailure(
                        f"{what}ranks {dead} exited without reporting (exit codes "
                        f"{[procs[r].exitcode for r in dead]})" + _errors_of(reports)
                    )
        failures = {r: v for r, (ok, v) in reports.items() if not ok}
        if failures:
            raise RankFailure(f"{what}{len(failures)} of {world_size} ranks failed"
                              + _errors_of(reports))
        for p in procs:
            p.join(timeout=max(1.0, min(grace, deadline - time.monotonic())))
        return [reports[r][1] for r in range(world_size)]
    finally:
        for p in procs:
            if p.pid is not None:
                _kill(p)
        results.close()
        results.cancel_join_thread()


def _errors_of(reports: dict) -> str:
    lines = []
    for rank in sorted(reports):
        ok, value = reports[rank]
        if not ok:
            lines.append(f"\n--- rank {rank} ---\n{str(value).rstrip()}")
    return "".join(lines)


# -- data paths ----------------------------------------------------------------------------------

#: How a rank's chunks reach a hub on its host: through a shared-memory segment the hub maps
#: (``shm``, gradstar's default there) or as frames on the gRPC stream (``stream``, the only
#: path to a hub on another host).
PATHS = ("shm", "stream")


def add_paths_argument(parser: argparse.ArgumentParser) -> None:
    """``--paths``: which data paths gradstar runs on, each a configuration of its own."""
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS),
                        help="run gradstar once per data path: shm (the same-host shared-memory "
                             "fast path) and/or stream (chunks on the gRPC stream, "
                             "GRADSTAR_SHARED_MEMORY=0 for the coordinator and the ranks); "
                             "default both")


def path_env(path: str) -> dict[str, str]:
    """The environment of the coordinator and the ranks of a configuration on ``path``. Set
    either way, so that a GRADSTAR_SHARED_MEMORY in the caller's environment cannot change
    the path a configuration is labelled with."""
    if path not in PATHS:
        raise ValueError(f"unknown data path {path!r}; expected one of {PATHS}")
    return {"GRADSTAR_SHARED_MEMORY": "1" if path == "shm" else "0"}


def shm_report(group) -> dict:
    """Run in a rank, after its timed loop and before it closes ``group`` (a gradstar
    ProcessGroup or AsyncProcessGroup): which data path its collectives took, for
    :func:`check_path`. ``shm_offered`` has one entry per target of the group's collectives (the
    hub, or each hub shard): whether the rank still offers it shared memory, which it stops
    doing for good once the target refuses (the reasons are in ``shm_refused``)."""
    from gradstar.transport import shm

    # The SDK has no public "which path did my collectives take": read the data plane.
    plane = getattr(group, "_group", group)._plane
    targets = plane.targets()
    return {"shm_supported": shm.supported(),
            "shm_offered": [t.shm.enabled for t in targets],
            "shm_refused": [f"{t.name}: {t.shm.refused}" for t in targets if t.shm.refused]}


def check_path(results: Sequence[dict], path: str, label: str,
               hub_mappings: int | None = None) -> None:
    """Raise :class:`BenchmarkError` unless every rank's collectives took ``path``, as each
    reported with :func:`shm_report`: for ``shm``, every target of every rank attached its
    segments; for ``stream``, none was offered any. ``hub_mappings``, if known
    (:meth:`CoordinatorProcess.shm_mappings` while the ranks were alive), must agree: some
    for ``shm``, none for ``stream``."""
    problems = []
    for rank, r in enumerate(results):
        if "shm_offered" not in r:
            problems.append(f"rank {rank} did not report its data path")
        elif path == "shm" and not r["shm_supported"]:
            problems.append(f"rank {rank}: this system has no sealable memfds")
        elif path == "shm" and not (r["shm_offered"] and all(r["shm_offered"])):
            why = "; ".join(r["shm_refused"]) or "no target took an offer"
            problems.append(f"rank {rank}: {why}")
        elif path == "stream" and any(r["shm_offered"]):
            problems.append(f"rank {rank} still offered shared memory to "
                            f"{sum(r['shm_offered'])} of its targets")
    if hub_mappings is not None and (hub_mappings > 0) != (path == "shm"):
        problems.append(f"the hub had {hub_mappings} ranks' segments mapped")
    if problems:
        raise BenchmarkError(f"[{label}] the configuration labelled {path!r} did not use the "
                             f"{path} data path: " + "; ".join(problems))


# -- output ------------------------------------------------------------------------------------


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table, right-aligned, with a rule under the header."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = [" | ".join(c.rjust(w) for c, w in zip(cells[0], widths, strict=True)),
           "-+-".join("-" * w for w in widths)]
    out += [" | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells[1:]]
    return "\n".join(out)


# -- drivers -----------------------------------------------------------------------------------


def add_run_arguments(parser: argparse.ArgumentParser, *, timeout: float = 600.0) -> None:
    """The ``--timeout`` (seconds per configuration) and ``--json`` options."""
    parser.add_argument("--timeout", type=float, default=timeout,
                        help="seconds allowed per configuration")
    parser.add_argument("--json", type=Path, help="also write the results here")


def run_configs(configs: Sequence[tuple[str, Callable[[], list]]],
                check: Callable[[list, str], None] | None = None
                ) -> tuple[dict[str, list | None], list[tuple[str, str]]]:
    """Run each ``(name, run)`` of ``configs`` in turn; ``run()`` returns one result per rank,
    each with the step ``"times"``. ``check(results, name)`` vets every configuration but
    ``"local"`` (the one without communication). Prints rank 0's median step time (or FAILED) per
    configuration to stderr and returns ``(runs, failures)``: the results by name (None for a
    configuration that failed) and ``(name, error message)`` per failure."""
    runs: dict[str, list | None] = {}
    failures: list[tuple[str, str]] = []
    for name, run in configs:
        t0 = time.monotonic()
        try:
            results = run()
            if check is not None and name != "local":
                check(results, name)
            runs[name] = results
            print(f"  {name:20s} median {median(results[0]['times']) * 1e3:9.1f} ms/step "
                  f"({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)
        except BenchmarkError as error:
            runs[name] = None
            failures.append((name, str(error)))
            print(f"  {name:20s} FAILED", file=sys.stderr, flush=True)
    return runs, failures


def write_json(args: argparse.Namespace, benchmark: str, **payload: object) -> None:
    """Write ``{"benchmark", "args", **payload}`` to ``args.json`` (the parsed options)."""
    args.json.write_text(json.dumps({"benchmark": benchmark, "args": vars(args) | {
        "json": str(args.json)}, **payload}, indent=2) + "\n")
