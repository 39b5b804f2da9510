"""An event loop on a daemon thread: how the blocking APIs (ProcessGroup, StreamingDiLoCo) run
their asyncio halves without re-implementing them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading


class LoopThread:
    """An event loop on a daemon thread, for blocking callers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="gradstar-loop",
                                        daemon=True)
        self._thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the loop soon (a plain function, not awaited)."""
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self) -> None:
        """Finish what is left on the loop, as ``asyncio.run`` does, then stop and close it.

        Left over after a failed join, for one: grpc's task feeding the session's request
        stream. Closing the loop under it made Python print "Task was destroyed but it is
        pending!" and "Event loop is closed" after the error the user needs to read.
        """
        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            self.submit(_finish_tasks()).result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


async def _finish_tasks() -> None:
    """Cancel every other task of the running loop, wait for them, and close async generators."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()
