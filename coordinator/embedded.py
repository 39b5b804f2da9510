"""A coordinator on a background thread, for programs that need a hub next to them
(the demo, a launcher without ``--coordinator``, notebooks)."""

from __future__ import annotations

import asyncio
import threading

from gradstar.config import CoordinatorSettings

from .server import Coordinator


class EmbeddedCoordinator:
    """``with EmbeddedCoordinator() as hub: hub.address`` — serves until the block ends.

    Raises:
        OSError: the coordinator could not bind its address.
    """

    def __init__(self, settings: CoordinatorSettings | None = None) -> None:
        self.settings = settings or CoordinatorSettings(host="127.0.0.1", port=0)
        self.coordinator = Coordinator(self.settings)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="gradstar-coordinator",
                                        daemon=True)

    @property
    def address(self) -> str:
        return self.coordinator.address

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            await self.coordinator.start()
        except BaseException as error:
            self._error = error
            self._ready.set()
            return
        self._ready.set()
        await self._stop.wait()
        await self.coordinator.stop(grace=0)

    def start(self, timeout: float = 30.0) -> EmbeddedCoordinator:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the embedded coordinator did not start within {timeout} s")
        if self._error is not None:
            raise self._error
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)

    def __enter__(self) -> EmbeddedCoordinator:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
