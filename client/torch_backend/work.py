"""The Work that gradstar's torch.distributed backend hands back to torch, and the threads that
complete it.

Three rules, each learned from a failure on torch 2.13:

* An exception set on a plain ``torch.futures.Future`` reaches C++ as an ordinary value: DDP's
  reducer then read it as a list of tensors and crashed with SIGSEGV. :meth:`GradstarWork.
  get_future` therefore returns a future *chained* with ``.then()`` whose callback raises the
  collective's error (handed to it as a :class:`_Failure` value), so C++ sees a properly failed
  future and throws.
* Futures are completed on :class:`CompletionThreads`, never on gradstar's asyncio loop thread:
  a callback may issue a collective and wait for it (PowerSGD does), which deadlocks if it runs
  on the thread that has to drive that collective. (A Work whose caller waits at once,
  torch's ``async_op=False``, is settled on the caller's own thread before torch sees it: no
  callback can be attached to it yet, and the hand-off to a completion thread cost each call
  two thread wake-ups; see :mod:`.group`.)
* :meth:`GradstarWork.wait` does not depend on the completion threads either: it settles the
  collective itself (waits for gradstar's result and writes it into torch's tensors) if no
  completion thread has yet, so a callback that waits for another collective cannot deadlock.
  Settling happens exactly once, under a lock.

A Work over CUDA tensors (``devices``: the CUDA devices of the tensors it reads and writes)
holds to torch's rules for them, as NCCL's and gloo's Works do:

* Its future is a ``torch.futures.Future(devices=...)``: torch then records an event on the
  completing thread's streams, makes every stream that waits for the future (or runs a
  ``.then()`` callback, on a stream of its own) wait for that event, and tells the caching
  allocator where the value's tensors are used. A future without devices does none of that: a
  comm hook's ``.then()`` callback (DDP's bf16 compression) would read the result on a stream
  that never waited for it.
* Results are written into torch's tensors by whichever thread settles the Work, on its
  current streams, which are then **synchronized** before the Work counts as settled: when
  ``wait()`` returns and when the future completes, the results are there for every stream.
* The future completes with the Work's first device current on the thread that settles it (a
  completion thread; for a Work ``settled`` on the caller's thread, the thread that first asks
  for the future, after its results were synchronized), so the callbacks torch runs under that
  device do not open a CUDA context on device 0 in a process that uses another device.

A Work may also carry the collective's profiler event (see :mod:`.profiling`): it ends on a
completion thread when the collective ends, before ``wait()`` returns and before the future
completes, so the event covers the collective and torch's profiler marks it async, as gloo's.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from gradstar.client.device import synchronize
from gradstar.errors import GradstarError

log = logging.getLogger(__name__)

_STOP = object()
#: How long ``wait()`` waits for the collective's profiler event to end after the collective
#: ended (a completion thread ends it at once; the bound only guards against a lost thread).
RECORD_END_WAIT = 10.0


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


def labelled(error: BaseException, label: str) -> BaseException:
    """``error`` with ``label`` (``"[Rank 0] "``) before its message, if it is a gradstar error:
    a copy (one error may be raised by many calls: a failed session's, for one), with the same
    type and fields. Torch's own backends name the rank in their errors the same way, and tests
    that grep for a word (``" Timed out "``) find it after the label."""
    if not (label and isinstance(error, GradstarError) and error.args
            and isinstance(error.args[0], str)) or error.args[0].startswith(label):
        return error
    named = copy.copy(error)
    named.args = (label + error.args[0], *error.args[1:])
    named.__cause__ = error.__cause__
    return named


class _Failure:
    """A collective's error, carried as the value of a Work's inner future to the ``.then()``
    callback that raises it (:func:`_reraise`).

    A future with devices pickles its value to find the tensors in it when it completes; an
    error holds none, and its fields need not pickle, so this pickles as an empty marker.
    """

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error

    def __reduce__(self):
        return _Failure, (None,)


def _reraise(fut: torch.futures.Future):
    # Runs as a .then() callback: raising here makes torch mark the chained future as failed
    # in C++ (see the module docstring).
    value = fut.value()
    if isinstance(value, _Failure):
        raise value.error
    return value


def _on_device(devices: Sequence[torch.device]):
    """A context making the first of ``devices`` (CUDA) this thread's current device; none
    for a Work without devices."""
    return torch.cuda.device(devices[0]) if devices else contextlib.nullcontext()


class GradstarWork(dist._Work):
    """One torch collective carried by one or more gradstar collectives.

    ``pending`` are gradstar :class:`~gradstar.client.work.Work` handles; ``finish`` receives
    their results (in order), writes them into torch's output tensors and returns the value of
    the torch future (the output tensors, as torch's own backends return). ``devices`` are the
    CUDA devices of the tensors the collective reads and writes (see the module docstring);
    unless ``settled``, the caller has synchronized their current streams before starting the
    collectives.

    ``settled``: the collectives have ended already, on the caller's thread (it waits at once
    and ran them to their end, :meth:`gradstar.client.process_group.ProcessGroup.settled`),
    so the results are
    written on this thread, now, rather than on a completion thread that this thread would wait
    for. On CUDA tensors the writes then run on the caller's own current streams, after
    everything it queued there, and are synchronized as above. Its torch future is made, and
    completed, only when :meth:`get_future` first asks (torch's waited calls never do): its
    event is then recorded on the asking thread's current streams, after results that are
    already there.
    """

    def __init__(self, pending: Sequence, finish: Callable[[list], object] | None,
                 completions: CompletionThreads, *, label: str = "",
                 devices: Sequence[torch.device] = (), inference: bool = False,
                 settled: bool = False) -> None:
        super().__init__()
        self._label = label  # prefixes the messages of the gradstar errors it raises
        self._pending = list(pending)
        self._count = len(self._pending)
        self._finish = finish
        self._completions = completions
        self._lock = threading.Lock()
        self._settled = False
        self._value: object = None
        self._error: BaseException | None = None
        self._devices = list(devices)
        # Outputs made under torch.inference_mode() (Lightning's validation metrics) may only be
        # written in place under it, and the thread that settles is not the caller's.
        self._inference = inference
        self._remaining = len(self._pending)
        self._count_lock = threading.Lock()
        # The profiler event (see record_until_done), ended as the collective completes.
        self._record = None
        self._record_ended: threading.Event | None = None
        self._completing = False
        if settled:
            # Settled already (see the class docstring): finish on this thread, no hand-off.
            # Its future is made when asked for (get_future): torch's waited calls never ask.
            self._raw = self._future = None
            self._completing = True
            if finish is not None:  # None: from_settled() settles it
                with _on_device(self._devices):
                    self._settle()
            return
        self._raw, self._future = self._new_future()
        if not self._pending:
            completions.submit(self._complete)
        for work in self._pending:
            # The callback runs on gradstar's loop thread (or here, if already done), so it
            # only hands over. Work has no public done-callback yet; its future is the contract.
            work._future.add_done_callback(self._one_done)

    @classmethod
    def failed(cls, error: BaseException, completions: CompletionThreads, *,
               label: str = "") -> GradstarWork:
        """A Work that fails with ``error`` (a collective that could not even start)."""

        def finish(_results):
            raise error

        return cls([], finish, completions, label=label)

    @classmethod
    def from_settled(cls, gradstar_work, value, completions: CompletionThreads, *,
              label: str = "") -> GradstarWork:
        """A Work settled at once from one gradstar collective that has ended already
        (``gradstar_work``, from :meth:`gradstar.client.process_group.ProcessGroup.settled`)
        and left nothing to write into torch's tensors: its result is in their memory already,
        or it has none (a barrier). ``value`` is what the Work's future completes with; if the
        collective failed, its error (labelled) is the Work's.

        The cheap form of ``settled`` for torch's waited calls on CPU tensors: no finish to run
        under ``torch.no_grad()``, no devices to synchronize."""
        work = cls((), None, completions, label=label, settled=True)
        work._count = 1
        try:
            gradstar_work.wait()
        except BaseException as error:
            work._error = labelled(error, label)
        else:
            work._value = value
        work._settled = True
        return work

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
                self._error = labelled(error, self._label)
            else:
                try:
                    try:
                        # Writing into torch's tensors is communication, not computation: keep
                        # it out of autograd (parameters that require grad are written in place).
                        with torch.inference_mode() if self._inference else torch.no_grad():
                            self._value = self._finish(results)
                    finally:
                        # The writes ran on this thread's current streams (some, if finish
                        # failed): done before anyone (wait(), the future, another stream, the
                        # caller reusing its tensors) reads or writes those tensors.
                        for device in self._devices:
                            synchronize(device)
                except BaseException as error:
                    self._error = labelled(error, self._label)
            self._settled = True
            # Torch may keep a Work long after it ended: drop the results and wire copies.
            self._pending, self._finish = [], None

    def abandon(self, error: BaseException) -> None:
        """Fail the gradstar collectives still running with ``error``: their loop is gone (the
        group was shut down), so nothing else would ever complete them, or this Work."""
        for work in list(self._pending):
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                work._future.set_exception(error)

    def record_until_done(self, record) -> None:
        """End ``record`` (a :class:`~.profiling.CollectiveRecord` started by the caller) when
        the collective ends, on a completion thread; ``wait()`` waits for that."""
        ended = threading.Event()
        with self._count_lock:
            self._record_ended = ended
            late = self._completing
            if not late:
                self._record = record
        if late:  # it ended already (or failed at once): end the event now, on another thread
            self._completions.submit(lambda: self._end(record, ended))

    @staticmethod
    def _end(record, ended: threading.Event) -> None:
        try:
            record.end()
        finally:
            ended.set()

    def _complete(self) -> None:
        with self._count_lock:
            self._completing = True
            record, self._record = self._record, None
        if record is not None:
            self._end(record, self._record_ended)
        with _on_device(self._devices):
            self._settle()
            self._raw.set_result(self._outcome())

    # -- torch's Work interface ----------------------------------------------------------------

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the collective ended and its results are in torch's tensors (on a CUDA
        device: complete, for every stream).

        Raises:
            GradstarError: the collective failed (mismatch, timeout, lost rank, ...).
            TimeoutError: ``timeout`` passed first (the collective keeps running).
        """
        seconds = None
        if timeout is not None and timeout > timedelta(0):
            seconds = timeout.total_seconds()
        try:
            self._settle(seconds)
        except TimeoutError:
            raise TimeoutError(f"Timed out waiting {seconds * 1000:g} ms for the collective "
                               "(it keeps running)") from None
        if self._record_ended is not None:
            self._record_ended.wait(RECORD_END_WAIT)
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        """A future of the output tensors; it fails with the collective's error."""
        future = self._future
        if future is not None:  # at once, even while another thread settles the Work
            return future
        # Settled here (see the class docstring): made and completed now, once. Not under
        # self._lock, which _settle holds while it waits.
        with self._count_lock:
            if self._future is None:
                with _on_device(self._devices):
                    raw, future = self._new_future()
                    raw.set_result(self._outcome())
                self._future = future
            return self._future

    def _new_future(self) -> tuple[torch.futures.Future, torch.futures.Future]:
        """(the future ``_complete`` sets, the one torch gets: it, chained to raise a failure)."""
        raw = torch.futures.Future(devices=self._devices)
        return raw, raw.then(_reraise)

    def _outcome(self):
        """What the settled Work's future completes with: its value, or its error carried."""
        return self._value if self._error is None else _Failure(self._error)

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


__all__ = ["RECORD_END_WAIT", "CompletionThreads", "GradstarWork", "labelled"]
