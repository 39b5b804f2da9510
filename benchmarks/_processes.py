"""The processes a benchmark starts, and how none of them outlives it.

* :class:`CoordinatorProcess` runs ``python -m gradstar coordinator --host 127.0.0.1 --port 0
  [--shards K]`` as a subprocess (as in a real deployment), parses the ``gradstar coordinator
  listening on HOST:PORT`` line (printed once all K shards registered), measures the CPU of the
  whole hub (the coordinator and its shard processes, from /proc), and stops it with SIGTERM (then
  SIGKILL, shards included) however the benchmark ends.
* :func:`track`, :func:`kill_and_reap`, :func:`die_with_parent`: every process started is killed
  at interpreter exit if still alive, and on Linux dies with its parent (even by SIGKILL).
* :func:`descendants`, :func:`cpu_seconds_of`: the process tree below a pid and a process's
  CPU time, from /proc.
* :func:`free_port`, :func:`loadavg`: small helpers.

Every wait here is bounded.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path

_LISTENING = re.compile(r"gradstar coordinator listening on (\S+):(\d+)")


class BenchmarkError(RuntimeError):
    """A configuration of a benchmark failed; the message says which and why."""


# -- processes we started, killed at interpreter exit if still alive --------------------------

_LIVE: set = set()


def _kill_leftovers() -> None:
    for proc in list(_LIVE):
        kill_and_reap(proc)


atexit.register(_kill_leftovers)


def kill_and_reap(proc) -> None:
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


def track(proc) -> None:
    """Kill ``proc`` (a ``subprocess.Popen`` or ``multiprocessing.Process``) at interpreter
    exit if it is still alive then; :func:`kill_and_reap` forgets it."""
    _LIVE.add(proc)


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


def die_with_parent() -> None:
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


def threads_cpu(pid: int | str = "self") -> dict[str, float]:
    """CPU seconds (user + system) of each thread of process ``pid`` (default: this one) so
    far, from /proc, summed by name with digits dropped: the OS's thread name (gRPC's
    ``event_engine``, the main thread's program name), or in this process Python's."""
    python = ({t.native_id: t.name for t in threading.enumerate()} if pid == "self" else {})
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        name = re.sub(r"\d+", "_", python.get(int(tid)) or comm)
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return out


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
                                     env=os.environ | self.env, preexec_fn=die_with_parent)
        track(self.proc)
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
                kill_and_reap(proc)
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


__all__ = ["BenchmarkError", "CoordinatorProcess", "cpu_seconds_of", "descendants",
           "die_with_parent", "free_port", "kill_and_reap", "loadavg", "track"]
