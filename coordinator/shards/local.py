"""Shard processes on the coordinator's own host: ``gradstar coordinator --shards K``.

Each shard is ``python -m gradstar shard`` bound to the coordinator's own host setting with a
free port, registering with the coordinator over loopback and asking for slot k. Tokens travel
in the child's environment, never on its command line (where every local user would see them in
``ps``). A shard that exits while the coordinator runs is restarted (after a short pause,
growing while it keeps failing) and asks for its old slot back; the generations striped over it
have failed by then (:mod:`.registry`), and later ones use it again.

Local shards advertise ``:PORT`` with no host: a rank reaches them at the host it reaches the
coordinator at, whatever name or NAT address that is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys

from gradstar.config import CoordinatorSettings

log = logging.getLogger(__name__)

_RESTART_PAUSES = (0.2, 0.5, 1.0, 2.0, 5.0)


class LocalShards:
    """Starts, watches and stops ``count`` shard processes for one coordinator."""

    def __init__(self, settings: CoordinatorSettings, coordinator_port: int, count: int) -> None:
        self.settings = settings
        self.coordinator = f"127.0.0.1:{coordinator_port}"
        self.count = count
        self.processes: dict[int, asyncio.subprocess.Process] = {}
        self._watchers: list[asyncio.Task] = []
        self._stopping = False

    def _command(self, slot: int) -> list[str]:
        s = self.settings
        command = [sys.executable, "-m", "gradstar", "shard", "--coordinator", self.coordinator,
                   "--host", s.host, "--port", "0", "--slot", str(slot),
                   "--advertise-host", "", "--log-level", s.log_level,
                   "--max-tensor-bytes", str(s.max_tensor_bytes),
                   "--max-chunk-bytes", str(s.max_chunk_bytes),
                   "--stream-window-bytes", str(s.stream_window_bytes),
                   "--max-collective-timeout", str(s.max_collective_timeout)]
        if s.tls_cert is not None:
            command += ["--tls-cert", str(s.tls_cert), "--tls-key", str(s.tls_key),
                        "--coordinator-ca", str(s.tls_cert)]
            if s.tls_client_ca is not None:
                command += ["--tls-client-ca", str(s.tls_client_ca)]
        if s.job_secret_file is not None:  # its ranks' own job tokens open the shards too
            command += ["--job-secret-file", str(s.job_secret_file.resolve())]
        if s.insecure:  # a coordinator allowed to serve unprotected: its shards are too
            command.append("--insecure")
        return command

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        s = self.settings
        for key, secret in (("GRADSTAR_TOKEN", s.token), ("GRADSTAR_ADMIN_TOKEN", s.admin_token)):
            if secret is not None:
                env[key] = secret.get_secret_value()
            else:
                env.pop(key, None)
        return env

    async def start(self) -> None:
        for slot in range(self.count):
            self._watchers.append(asyncio.create_task(self._keep(slot),
                                                      name=f"gradstar-shard-{slot}"))

    async def _keep(self, slot: int) -> None:
        failures = 0
        while not self._stopping:
            # A session of its own: a terminal's Ctrl-C (SIGINT to the foreground process group)
            # reaches the coordinator alone, which then stops its shards itself, instead of
            # killing them under it (which read as a shard failure, and a restart).
            process = await asyncio.create_subprocess_exec(
                *self._command(slot), env=self._env(), stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True)
            self.processes[slot] = process
            code = await process.wait()
            if self._stopping:
                return
            pause = _RESTART_PAUSES[min(failures, len(_RESTART_PAUSES) - 1)]
            failures += 1
            log.warning("shard %d (pid %d) exited with %s; restarting in %.1f s", slot,
                        process.pid, code, pause)
            await asyncio.sleep(pause)

    async def stop(self, timeout: float = 5.0) -> None:
        """Terminate every shard, killing those that do not exit within ``timeout``."""
        self._stopping = True
        for task in self._watchers:
            task.cancel()
        for task in self._watchers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for process in self.processes.values():
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.terminate()
        for process in self.processes.values():
            try:
                await asyncio.wait_for(process.wait(), timeout)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
