"""Rank processes: run a function in N spawned processes and collect what each returns.

* :func:`run_ranks` runs ``target(rank, world_size, *args)`` in ``world_size`` spawned processes
  and collects one result per rank, with a hard deadline: a rank that raises, dies or does not
  report in time makes it raise :class:`RankFailure`, and every child is killed before it returns.
* :class:`DriverSync` holds the ranks at chosen points of their loop until this process has acted
  (for instance sampled the hub's CPU right before and after the timed iterations).

Every wait here is bounded.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Mapping

from _processes import BenchmarkError, die_with_parent, kill_and_reap, track


class RankFailure(BenchmarkError):
    """One or more rank processes raised, died or timed out."""



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
    die_with_parent()
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
            track(p)
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
                kill_and_reap(p)
        results.close()
        results.cancel_join_thread()


def _errors_of(reports: dict) -> str:
    lines = []
    for rank in sorted(reports):
        ok, value = reports[rank]
        if not ok:
            lines.append(f"\n--- rank {rank} ---\n{str(value).rstrip()}")
    return "".join(lines)


__all__ = ["DriverSync", "RankFailure", "SyncPoints", "run_ranks"]
