"""Work: the handle an ``async_op=True`` collective returns, as in torch.distributed."""

from __future__ import annotations

import concurrent.futures


class Work:
    """A collective running in the background. ``wait()`` returns its result or raises its error."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    def wait(self, timeout: float | None = None):
        """Block until the collective ends; return its result.

        Raises:
            GradstarError: the collective failed (the same error the blocking call raises).
            TimeoutError: ``timeout`` seconds passed first (the collective keeps running).
        """
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"collective still running after {timeout} s") from None

    def result(self):
        return self.wait()

    def is_completed(self) -> bool:
        return self._future.done()

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None


class SettledWork(Work):
    """A collective that ran to its end before its Work was made (on the caller's thread, by
    the blocking API's direct lane): its result, or its error, held for ``wait()``. No future:
    nothing is left to run or to wait for."""

    def __init__(self, value=None, error: BaseException | None = None) -> None:
        self._value = value
        self._error = error

    def wait(self, timeout: float | None = None):
        if self._error is not None:
            raise self._error
        return self._value

    def is_completed(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return self._error

