"""The Work that gradstar's torch.distributed backend hands back to torch, and the threads that
complete it.

Three rules, each learned from a failure on torch 2.13:

* An exception set on a plain ``torch.futures.Future`` reaches C++ as an ordinary value: DDP's
  reducer then read it as a list of tensors and crashed with SIGSEGV. :meth:`GradstarWork.
  get_future` therefore returns a future *chained* with ``.then()`` whose callback re-raises, so
  C++ sees a properly failed future and throws.
* Futures are completed on :class:`CompletionThreads`, never on gradstar's asyncio loop thread:
  a callback may issue a collective and wait for it (PowerSGD does), which deadlocks if it runs
  on the thread that has to drive that collective.
* :meth:`GradstarWork.wait` does not depend on the completion threads either: it settles the
  collective itself (waits for gradstar's result and writes it into torch's tensors) if no
  completion thread has yet, so a callback that waits for another collective cannot deadlock.
  Settling happens exactly once, under a lock.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_STOP = object()


class CompletionThreads:
    """Daemon threads that finish collectives and run their futures' callbacks.

    A new thread starts whenever work arrives and no thread is idle, so a callback that blocks
    (waiting for another collective) never holds up the completion of others. Threads are
    reused; :meth:`close` stops them.
    """

    def __init__(self, name: str = "gradstar-torch-completion") -> None:
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on a completion thread (a new one if none is idle)."""
        with self._lock:
            closed = self._closed
            if not closed:
                self._queue.put(fn)
                if not self._idle.acquire(blocking=False):
                    thread = threading.Thread(target=self._run, daemon=True,
                                              name=f"{self._name}-{len(self._threads)}")
                    self._threads.append(thread)
                    thread.start()
        if closed:
            # After shutdown, complete inline rather than never: nothing may wait forever.
            fn()

    def _run(self) -> None:
        while (fn := self._queue.get()) is not _STOP:
            try:
                fn()
            except BaseException:  # a completion must never kill the thread silently
                log.exception("completing a gradstar collective failed")
            self._idle.release()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the threads once the queued work is done; bounded by ``timeout`` per thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(_STOP)
        current = threading.current_thread()
        for thread in threads:
            if thread is not current:
                thread.join(timeout)


def _reraise(fut: torch.futures.Future):
    # Runs as a .then() callback: value() raises the stored exception, and torch marks the
    # chained future as failed in C++ (see the module docstring).
    return fut.value()


class GradstarWork(dist._Work):
    """One torch collective carried by one or more gradstar collectives.

    ``pending`` are gradstar :class:`~gradstar.client.work.Work` handles; ``finish`` receives
    their results (in order), writes them into torch's output tensors and returns the value of
    the torch future (the output tensors, as torch's own backends return).
    """

    def __init__(self, pending: Sequence, finish: Callable[[list], object],
                 completions: CompletionThreads) -> None:
        super().__init__()
        self._pending = list(pending)
        self._count = len(self._pending)
        self._finish = finish
        self._completions = completions
        self._lock = threading.Lock()
        self._settled = False
        self._value: object = None
        self._error: BaseException | None = None
        self._raw = torch.futures.Future()
        self._future = self._raw.then(_reraise)
        self._remaining = len(self._pending)
        self._count_lock = threading.Lock()
        if not self._pending:
            completions.submit(self._complete)
        for work in self._pending:
            # The callback runs on gradstar's loop thread (or here, if already done), so it
            # only hands over. Work has no public done-callback yet; its future is the contract.
            work._future.add_done_callback(self._one_done)

    @classmethod
    def failed(cls, error: BaseException, completions: CompletionThreads) -> GradstarWork:
        """A Work that fails with ``error`` (a collective that could not even start)."""

        def finish(_results):
            raise error

        return cls([], finish, completions)

    def _one_done(self, _future: concurrent.futures.Future) -> None:
        with self._count_lock:
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._completions.submit(self._complete)

    def _settle(self, timeout: float | None = None) -> None:
        with self._lock:
            if self._settled:
                return
            try:
                results = [work.wait(timeout) for work in self._pending]
            except TimeoutError:
                raise  # still running: settle later
            except BaseException as error:
                self._error = error
            else:
                try:
                    # Writing into torch's tensors is communication, not computation: keep it
                    # out of autograd (parameters that require grad are written in place).
                    with torch.no_grad():
                        self._value = self._finish(results)
                except BaseException as error:
                    self._error = error
            self._settled = True
            # Torch may keep a Work long after it ended: drop the results and wire copies.
            self._pending, self._finish = [], None

    def abandon(self, error: BaseException) -> None:
        """Fail the gradstar collectives still running with ``error``: their loop is gone (the
        group was shut down), so nothing else would ever complete them, or this Work."""
        for work in list(self._pending):
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                work._future.set_exception(error)

    def _complete(self) -> None:
        self._settle()
        if self._error is not None:
            self._raw.set_exception(self._error)
        else:
            self._raw.set_result(self._value)

    # -- torch's Work interface ----------------------------------------------------------------

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the collective ended and its results are in torch's tensors.

        Raises:
            GradstarError: the collective failed (mismatch, timeout, lost rank, ...).
            TimeoutError: ``timeout`` passed first (the collective keeps running).
        """
        seconds = None
        if timeout is not None and timeout > timedelta(0):
            seconds = timeout.total_seconds()
        self._settle(seconds)
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        """A future of the output tensors; it fails with the collective's error."""
        return self._future

    def is_completed(self) -> bool:
        return self._settled

    def is_success(self) -> bool:
        return self._settled and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self):
        self.wait()
        return self._value

    def __repr__(self) -> str:
        state = ("failed" if self._error else "done") if self._settled else "running"
        return f"GradstarWork({state}, {self._count} gradstar collective(s))"


__all__ = ["CompletionThreads", "GradstarWork"]
