"""A client of the coordinator's Admin and health services, for operators and the agent.

``gradstar admin`` renders what it returns (:mod:`gradstar.worker.admin.tables`); the worker
agent uses :meth:`AdminClient.wait_serving` before it starts ranks, and ``gradstar demo`` reads
its job's byte counters with it. Every call has a deadline.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gradstar.errors import AuthenticationError, CoordinatorUnavailableError, GradstarError
from gradstar.proto.v1 import admin_pb2, admin_pb2_grpc
from gradstar.transport.auth import bearer
from gradstar.transport.channels import client_credentials, secure_or_insecure_channel

CALL_TIMEOUT = 10.0


class AdminClient:
    """``async with AdminClient("host:29400", admin_token=...) as admin: await admin.jobs()``.

    ``admin_token`` is sent on Admin calls (health needs none). TLS when ``tls_ca`` or a client
    certificate is given, as for process groups.
    """

    def __init__(self, address: str, admin_token: str | None = None, *,
                 tls_ca: Path | None = None, tls_cert: Path | None = None,
                 tls_key: Path | None = None, timeout: float = CALL_TIMEOUT) -> None:
        self.address = address
        self.timeout = timeout
        creds = (client_credentials(tls_ca, tls_cert, tls_key) if tls_ca or tls_cert else None)
        self._channel = secure_or_insecure_channel(address, creds)
        self._metadata = bearer(admin_token) if admin_token else ()
        self._admin = admin_pb2_grpc.AdminStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def health(self) -> str:
        """The coordinator's overall health: ``"SERVING"`` or ``"NOT_SERVING"`` (draining).

        Raises:
            CoordinatorUnavailableError: no answer within the timeout.
        """
        reply = await self._call(self._health.Check(health_pb2.HealthCheckRequest(service=""),
                                                    timeout=self.timeout), "the health check")
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def wait_serving(self, timeout: float, poll: float = 0.5) -> None:
        """Return once the coordinator reports SERVING; poll for at most ``timeout`` seconds.

        Raises:
            CoordinatorUnavailableError: it did not, naming the last answer or error.
        """
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            try:
                status = await self.health()
                if status == "SERVING":
                    return
                last = f"it reports {status}"
            except CoordinatorUnavailableError as error:
                last = str(error)
            if time.monotonic() + poll > deadline:
                raise CoordinatorUnavailableError(
                    f"the coordinator at {self.address} was not SERVING within {timeout:g} s "
                    f"({last})")
            await asyncio.sleep(poll)

    async def jobs(self) -> list[admin_pb2.JobSummary]:
        """Every job, page after page."""
        jobs: list[admin_pb2.JobSummary] = []
        token = ""
        while True:
            reply = await self._call(self._admin.ListJobs(
                admin_pb2.ListJobsRequest(page_token=token), timeout=self.timeout,
                metadata=self._metadata), "listing jobs")
            jobs.extend(reply.jobs)
            token = reply.next_page_token
            if not token:
                return jobs

    async def job(self, name: str) -> admin_pb2.GetJobResponse:
        """Raises: GradstarError if the coordinator has no job ``name``."""
        return await self._call(self._admin.GetJob(
            admin_pb2.GetJobRequest(job=name), timeout=self.timeout, metadata=self._metadata),
            f"reading job {name!r}")

    async def shards(self) -> admin_pb2.ListShardsResponse:
        """The coordinator's data-plane shards (slot, address, state, traffic, jobs)."""
        return await self._call(self._admin.ListShards(
            admin_pb2.ListShardsRequest(), timeout=self.timeout, metadata=self._metadata),
            "listing shards")

    async def rounds(self, job: str) -> admin_pb2.ListRoundsResponse:
        """Raises: GradstarError if the coordinator has no outer rounds for ``job``."""
        return await self._call(self._admin.ListRounds(
            admin_pb2.ListRoundsRequest(job=job), timeout=self.timeout,
            metadata=self._metadata), f"reading the rounds of job {job!r}")

    async def steps(self, job: str) -> admin_pb2.ListStepsResponse:
        """Raises: GradstarError if the coordinator has no sync-mode steps for ``job``."""
        return await self._call(self._admin.ListSteps(
            admin_pb2.ListStepsRequest(job=job), timeout=self.timeout,
            metadata=self._metadata), f"reading the sync-mode steps of job {job!r}")
    async def stragglers(self, job: str, limit: int = 0) -> admin_pb2.GetStragglersResponse:
        """Per rank arrival lag and cost, slowest first. Raises: GradstarError if the
        coordinator has no job ``job``."""
        return await self._call(self._admin.GetStragglers(
            admin_pb2.GetStragglersRequest(job=job, limit=limit), timeout=self.timeout,
            metadata=self._metadata), f"reading the stragglers of job {job!r}")

    async def leadership(self) -> admin_pb2.GetLeadershipResponse:
        """Which coordinator leads (under --ha), since when, how many takeovers."""
        return await self._call(self._admin.GetLeadership(
            admin_pb2.GetLeadershipRequest(), timeout=self.timeout, metadata=self._metadata),
            "reading who leads")

    async def drain(self) -> int:
        """Start draining; returns how many jobs still have live members."""
        reply = await self._call(self._admin.Drain(
            admin_pb2.DrainRequest(), timeout=self.timeout, metadata=self._metadata), "draining")
        return reply.active_jobs

    async def _call(self, call, what: str):
        try:
            return await call
        except grpc.RpcError as error:
            code, details = error.code(), error.details() or ""
            if code == grpc.StatusCode.UNAUTHENTICATED:
                raise AuthenticationError(
                    f"the coordinator at {self.address} refused {what}: {details} (pass "
                    "--admin-token or set GRADSTAR_ADMIN_TOKEN)") from None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise CoordinatorUnavailableError(
                    f"could not reach the coordinator at {self.address} for {what}: "
                    f"{details or code.name}") from None
            raise GradstarError(f"{what} failed at {self.address}: {code.name}: {details}") \
                from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AdminClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
