"""``gradstar worker``: the per-host agent (what a docker-compose worker service runs).

What it does, in order:

1. Waits (at most ``wait_coordinator`` seconds) until the coordinator's gRPC health service
   reports SERVING, so containers started together do not race the hub; then, when the job's
   ranks span hosts (or the coordinator is on another one), starts this host's node-local
   shard for the job (:mod:`gradstar.node_shard`; ``--no-node-shard`` or
   ``GRADSTAR_NODE_SHARD=0`` turn it off), which lives as long as the agent.
2. Starts ``nproc`` local ranks of the command with ``GRADSTAR_*`` set. When the job's world
   size equals ``nproc`` the ranks are 0..nproc-1; with a larger world (several agents, e.g.
   docker-compose's worker replicas) ``GRADSTAR_RANK`` stays unset and the coordinator assigns
   ranks.
3. Restarts a rank that dies, up to ``max_restarts`` times in total for this agent, with
   ``GRADSTAR_RESTART_COUNT`` telling it which restart it is. The rank's own loss fails the
   job's generation on the hub; the surviving ranks (anywhere) re-join, and the rendezvous forms
   the next generation when the restarted rank joins too. Re-joining is the training script's
   part: :mod:`gradstar.worker.demo.train` does it, resuming from the hub's global model with
   LocalSGD (see its docstring). Ranks that are :class:`gradstar.StreamingDiLoCo` replicas form
   no generation: the others train on, and the restarted rank (same ``GRADSTAR_RANK``, so the
   same replica name) rejoins the hub's rounds from its global model. When no restart is left,
   the agent stops its other ranks and exits with the failed rank's code.

Health is reported two ways: a log line on stderr for every start, exit and restart, and, with
``--health-port``, an HTTP endpoint ``GET /healthz`` answering JSON (the agent's state, each
local rank's pid, state, restarts and last exit, and whether the coordinator answers its health
check) with status 200 while the agent is starting, running or succeeded, 503 once it failed.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import sys
from pathlib import Path

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gradstar import node_shard
from gradstar.errors import GradstarError
from gradstar.transport.addresses import is_loopback, split_host_port

from ..admin.client import AdminClient
from .supervisor import RankSupervisor, rank_env, run_with_signals


class AgentSettings(BaseSettings):
    """``gradstar worker`` settings: flags, else ``GRADSTAR_*`` env vars, else these."""

    model_config = SettingsConfigDict(env_prefix="GRADSTAR_", extra="ignore")

    coordinator: str
    job: str = "default"
    nproc: int = Field(1, ge=1, description="rank processes on this host")
    world_size: int | None = Field(None, ge=1, description="ranks of the whole job (all hosts)")
    max_restarts: int = Field(0, ge=0, description="rank restarts this agent may do in total")
    health_host: str = "0.0.0.0"
    health_port: int | None = Field(None, ge=0, le=65535)
    stop_grace: float = Field(5.0, ge=0, description="seconds between SIGTERM and SIGKILL")
    wait_coordinator: float = Field(120.0, gt=0, description="seconds to wait for SERVING")
    token: SecretStr | None = None  # passed on to the ranks through the environment
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    node_shard: bool = Field(
        True, description="run a node-local hub shard for the job on this host when its ranks "
                          "span hosts or the coordinator is elsewhere (gradstar.node_shard)")
    shard_tls_cert: Path | None = Field(
        None, description="with TLS, the node-local shard's server certificate for this host")
    shard_tls_key: Path | None = None

    @model_validator(mode="after")
    def _shard_tls_pair(self) -> AgentSettings:
        if (self.shard_tls_cert is None) != (self.shard_tls_key is None):
            raise ValueError("shard_tls_cert and shard_tls_key go together")
        return self


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class WorkerAgent:
    """One host's agent; ``await WorkerAgent(settings, command).run()`` returns the exit code."""

    def __init__(self, settings: AgentSettings, command: list[str]) -> None:
        self.settings = settings
        self.command = command
        self.world_size = settings.world_size or settings.nproc
        explicit = self.world_size == settings.nproc
        self.supervisor = RankSupervisor(
            command, settings.nproc, self._env_for, max_restarts=settings.max_restarts,
            stop_grace=settings.stop_grace, log=_log, name="gradstar worker",
            label="rank" if explicit else "local rank")
        self.health_port: int | None = None
        self._explicit = explicit
        self._admin: AdminClient | None = None
        self.shard: node_shard.NodeShard | None = None

    def _wants_shard(self) -> str | None:
        """Why this agent runs no node-local shard, or None when it runs one."""
        s = self.settings
        if not (s.node_shard and node_shard.wanted()):
            return "turned off"
        if self.world_size == s.nproc and is_loopback(split_host_port(s.coordinator)[0]):
            return "every rank and the coordinator are on this host"
        if (s.tls_ca or s.tls_cert) and s.shard_tls_cert is None:
            return ("the job uses TLS, and a shard needs a server certificate for this host "
                    "(--shard-tls-cert, --shard-tls-key)")
        return None

    def _env_for(self, local_rank: int, restart: int) -> dict[str, str]:
        s = self.settings
        env = rank_env(os.environ, coordinator=s.coordinator, job=s.job,
                       world_size=self.world_size, local_rank=local_rank, nproc=s.nproc,
                       restart=restart, rank=local_rank if self._explicit else None)
        if s.token is not None:
            env["GRADSTAR_TOKEN"] = s.token.get_secret_value()
        return env

    async def run(self) -> int:
        from gradstar.transport.bind import describe_bind_error
        from gradstar.transport.http import bound_port, serve_http

        s = self.settings
        if self.world_size < s.nproc:
            _log(f"gradstar worker: world size {self.world_size} is smaller than --nproc "
                 f"{s.nproc}")
            return 2
        server = None
        if s.health_port is not None:
            try:
                server = await serve_http(s.health_host, s.health_port,
                                          {"/healthz": self._health_page})
            except OSError as error:  # a mistake in how the agent was started: one line
                _log("gradstar worker: " + describe_bind_error(error, s.health_host,
                                                               s.health_port, "--health-port"))
                return 2
            self.health_port = bound_port(server)
        self._admin = AdminClient(s.coordinator, tls_ca=s.tls_ca, tls_cert=s.tls_cert,
                                  tls_key=s.tls_key, timeout=2.0)
        try:
            if server is not None:
                _log(f"gradstar worker: health on http://{s.health_host}:{self.health_port}"
                     "/healthz")
            _log(f"gradstar worker: job {s.job!r}, {s.nproc} local rank(s) of a world of "
                 f"{self.world_size}, up to {s.max_restarts} restart(s); waiting for the "
                 f"coordinator at {s.coordinator}")
            try:
                await self._admin.wait_serving(s.wait_coordinator)
            except GradstarError as error:
                _log(f"gradstar worker: {error}")
                self.supervisor.state = "failed"
                return 1
            if (why_not := self._wants_shard()) is None:
                token = s.token.get_secret_value() if s.token is not None else None
                tls = (node_shard.ShardTLS(s.shard_tls_cert, s.shard_tls_key, s.tls_ca,
                                           mutual=s.tls_cert is not None)
                       if s.shard_tls_cert is not None else None)
                self.shard = await asyncio.to_thread(node_shard.start, s.coordinator, s.job,
                                                     token, tls)
                if self.shard is not None:
                    _log(f"gradstar worker: node-local shard for job {s.job!r} at "
                         f"{self.shard.address}")
            else:
                _log(f"gradstar worker: no node-local shard ({why_not})")
            _log(f"gradstar worker: coordinator SERVING; starting `{shlex.join(self.command)}`")
            try:
                outcome = await run_with_signals(self.supervisor)
            except OSError as error:
                _log(f"gradstar worker: could not start `{self.command[0]}`: {error}")
                self.supervisor.state = "failed"
                return 127
            _log(outcome.message)
            return outcome.exit_code
        finally:
            if self.shard is not None:
                await asyncio.to_thread(self.shard.stop)
            if server is not None:
                server.close()
            await self._admin.close()

    async def health(self) -> dict:
        """The agent's health report (the body of ``/healthz``)."""
        s = self.settings
        try:
            coordinator = await self._admin.health()
        except GradstarError as error:
            coordinator = f"unreachable: {error}"
        report = self.supervisor.snapshot()
        report.update(job=s.job, world_size=self.world_size, coordinator=s.coordinator,
                      node_shard=self.shard.address if self.shard is not None else None,
                      coordinator_health=coordinator,
                      healthy=report["state"] in ("starting", "running", "succeeded"))
        return report

    async def _health_page(self) -> tuple[int, str, bytes]:
        report = await self.health()
        body = (json.dumps(report, indent=2) + "\n").encode()
        return (200 if report["healthy"] else 503), "application/json", body


def run_agent(settings: AgentSettings, command: list[str]) -> int:
    return asyncio.run(WorkerAgent(settings, command).run())
