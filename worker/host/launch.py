"""``gradstar launch``: run N ranks of a training script on this machine, like ``torchrun``.

Without ``--coordinator`` an embedded coordinator (127.0.0.1, a free port, the
``GRADSTAR_TOKEN`` of the environment if any) serves the job for as long as the launch runs.
Ranks are 0..N-1, set through ``GRADSTAR_RANK``; their output is prefixed ``[rank N]``. The first
rank that fails stops the others, and the launch exits with that rank's exit code (128 + the
signal number if a signal killed it), naming the rank and how it ended. ``--max-restarts``
restarts failed ranks instead, as the worker agent does. With ``--coordinator`` on another host,
a node-local shard for the job runs beside the ranks while they run (:mod:`gradstar.node_shard`;
``GRADSTAR_NODE_SHARD=0`` turns it off).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import sys
from dataclasses import dataclass

from gradstar import node_shard
from gradstar.transport.addresses import is_loopback, split_host_port

from .supervisor import RankSupervisor, rank_env, run_with_signals


@dataclass(frozen=True)
class LaunchOptions:
    command: list[str]
    nproc: int
    coordinator: str | None = None
    job: str = "launch"
    max_restarts: int = 0
    stop_grace: float = 5.0


def script_command(script: str, args: list[str], *, module: bool = False,
                   no_python: bool = False) -> list[str]:
    """The argv of a rank: ``python script args``, ``python -m module args`` or ``script args``."""
    if no_python:
        return [script, *args]
    return [sys.executable, *(["-m"] if module else []), script, *args]


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _show_coordinator_warnings() -> None:
    """The embedded coordinator's warnings (a rank lost, heartbeats missed) on stderr, marked as
    the coordinator's, unless the program configured logging itself."""
    logger = logging.getLogger("gradstar.coordinator")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("gradstar launch: coordinator: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False


def run_launch(options: LaunchOptions) -> int:
    """Run the ranks to completion; return the launcher's exit code."""
    from gradstar.coordinator import EmbeddedCoordinator

    hub = None
    address = options.coordinator
    if address is None:
        _show_coordinator_warnings()
        try:
            hub = EmbeddedCoordinator().start()
        except OSError as error:
            _log(f"gradstar launch: could not start the embedded coordinator: {error}")
            return 1
        address = hub.address
    shard = None
    if hub is None and not is_loopback(split_host_port(address)[0]) and node_shard.wanted():
        # The coordinator is elsewhere: this host's ranks reduce through a shard beside them
        # (shared memory), and only the shard's result crosses the link.
        shard = node_shard.start(address, options.job)
    try:
        where = "embedded" if hub is not None else "given"
        _log(f"gradstar launch: {options.nproc} rank(s) of `{shlex.join(options.command)}`, "
             f"job {options.job!r}, coordinator {address} ({where})")

        def env_for(local_rank: int, restart: int) -> dict[str, str]:
            return rank_env(os.environ, coordinator=address, job=options.job,
                            world_size=options.nproc, local_rank=local_rank,
                            nproc=options.nproc, restart=restart, rank=local_rank)

        supervisor = RankSupervisor(options.command, options.nproc, env_for,
                                    max_restarts=options.max_restarts,
                                    stop_grace=options.stop_grace, log=_log,
                                    name="gradstar launch")
        try:
            outcome = asyncio.run(run_with_signals(supervisor))
        except OSError as error:
            _log(f"gradstar launch: could not start `{options.command[0]}`: {error}")
            return 127
        _log(outcome.message)
        return outcome.exit_code
    finally:
        if shard is not None:
            shard.stop()
        if hub is not None:
            hub.stop()
