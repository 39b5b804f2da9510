"""Settings of the coordinator and of client process groups.

Both read ``GRADSTAR_*`` environment variables as defaults (pydantic-settings); explicit
arguments win. Tokens are ``SecretStr`` so they never appear in a repr or a log line.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gradstar.errors import ConfigurationError
from gradstar.wire import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES

DEFAULT_PORT = 29400
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: Token values of examples (``.env.example``'s, and the usual "change me" kind): public, so
#: never a secret. A value equal to one of these, or starting with one of the prefixes, is one.
PLACEHOLDER_TOKENS = frozenset({
    "replace-with-a-job-token", "replace-with-an-admin-token", "change-me", "changeme",
    "change-this", "changethis", "replace-me", "replaceme",
})
_PLACEHOLDER_PREFIXES = ("replace-with-", "change-me-", "changeme-", "your-")


def is_placeholder_token(token: str) -> bool:
    """Whether ``token`` is an example value (``replace-with-...``, ``change-me``, ``<token>``)
    rather than a secret."""
    value = token.strip().lower()
    return (value in PLACEHOLDER_TOKENS or value.startswith(_PLACEHOLDER_PREFIXES)
            or (value.startswith("<") and value.endswith(">")))


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (``localhost``, 127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def size_limits_text(world_size: int, min_world_size: int, max_world_size: int,
                     resizes: int, joining: int, departing: int) -> str:
    """A job's size limits as torchrun writes them ("fixed", or MIN..MAX), with the ranks
    waiting to join or departing at its next step boundary: what the status page and
    ``gradstar admin`` show."""
    top = max(max_world_size, world_size)
    if top <= world_size and not min_world_size and not resizes:
        return "fixed"
    text = f"{min_world_size or 1}..{top}"
    return text + (f" (+{joining} -{departing} next step)" if joining or departing else "")


def default_shard_count(cores: int | None = None) -> int:
    """``--shards auto``: one shard per two cores beyond the first two, at most 8.

    A shard moves about one core's worth of bytes (the hub is one busy thread), and the ranks
    on the same machine need cores too; on 2 cores the hub stays in one process.
    """
    cores = cores or os.cpu_count() or 1
    return max(0, min(8, (cores - 2) // 2))


class CoordinatorSettings(BaseSettings):
    """Everything ``gradstar coordinator`` can be told, from flags or ``GRADSTAR_*`` env vars."""

    model_config = SettingsConfigDict(env_prefix="GRADSTAR_", extra="ignore")

    host: str = "0.0.0.0"
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    token: SecretStr | None = None
    admin_token: SecretStr | None = None
    # A file only: the secret opens every job, and a command line is visible in ps.
    job_secret_file: Path | None = Field(
        None, description="file holding the operator's job secret: each job's own token, "
                          "derived from it (gradstar admin job-token), then opens that job "
                          "only (gradstar.transport.job_tokens); the shared token still opens "
                          "every job")
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = Field(
        None, description="CA bundle that client certificates must chain to (mutual TLS)"
    )
    max_tensor_bytes: int = Field(8 << 30, gt=0, description="largest payload one rank may send")
    max_collective_state_bytes: int = Field(
        256 << 20, gt=0,
        description="budget for the bookkeeping of all pending collectives (chunk trackers, "
                    "participant records); a header beyond it is refused (HubCapacityError)")
    collective_state_job_share: float = Field(
        0.25, gt=0, le=1,
        description="the part of max_collective_state_bytes one job may hold, alone on the hub "
                    "or not, so that a job that fills its share leaves room for the others' "
                    "collectives (1: no per-job limit); beyond it the job's headers are "
                    "refused (HubCapacityError)")
    max_steps_bytes: int = Field(
        4 << 30, gt=0,
        description="memory for the sync-mode DDP steps of all jobs (open steps' gradients, "
                    "the aggregate logs, the snapshots); a gradient or snapshot beyond it is "
                    "refused (HubCapacityError) once no aggregate a rank still needs can go")
    steps_job_share: float = Field(
        0.5, gt=0, le=1,
        description="the part of max_steps_bytes one job may hold (its open steps, aggregate "
                    "logs, snapshots and uploads in flight), alone on the hub or not, so that "
                    "one job that fills its share leaves room for the others (1: no per-job "
                    "limit)")
    max_pending_per_member: int = Field(
        1024, gt=0, description="collectives one rank may have pending on the hub at once")
    max_pending_per_job: int = Field(
        8192, gt=0, description="collectives one job may have pending on the hub at once")
    shared_memory: bool = Field(
        True, description="attach the shared-memory segments ranks on this host offer, so "
                          "their payloads skip the network stack (see gradstar.transport.shm)")
    max_chunk_bytes: int = Field(MAX_CHUNK_BYTES, gt=0, le=MAX_CHUNK_BYTES)
    # gRPC's own windows follow its estimate of the bandwidth-delay product (BDP probing), which
    # a loaded host inflates: on 2 busy cores the hub's estimate per connection reached 18 MB
    # (1.5-4 MB in quiet runs), and a 4 x 64 MiB all_gather with one rank 3 s late grew the hub
    # by 65-178 MiB; with 4 MiB windows by 65-78 (tests/robustness/test_memory.py). 4 MiB covers a
    # link's bandwidth-delay product up to 3.3 Gbit/s at 10 ms round trip, and is close to
    # Linux's own largest TCP receive buffer (tcp_rmem, 6 MiB), which bounds gloo on that link.
    stream_window_bytes: int = Field(
        4 << 20, ge=0, le=(1 << 31) - 1,
        description="bytes of each rank's stream the hub's gRPC accepts ahead of what the hub "
                    "has read (its HTTP/2 receive window per stream), so what a stream the hub "
                    "holds back costs it besides; raise it for links whose bandwidth x round "
                    "trip exceeds it; 0: gRPC's own windows, sized by probing, unbounded")
    collective_port: int = Field(
        0, ge=0, le=65535,
        description="the port for collectives' tensors (0 picks a free one): a server of their "
                    "own whose keepalive tolerates full links, apart from the sessions' port "
                    "whose keepalive pings find lost ranks; open it where a firewall or Service "
                    "lists ports")
    heartbeat_interval: float = Field(1.0, gt=0)
    # Frozen or partitioned ranks are found by gRPC keepalive in ~5 s; heartbeats catch a rank
    # whose process lives but whose gradstar event loop stopped.
    heartbeat_timeout: float = Field(15.0, gt=0)
    max_collective_timeout: float = Field(
        1800.0, gt=0, description="upper bound on the timeout a client may ask for"
    )
    state_dir: Path | None = Field(
        None, description="where each job's global model is saved after every averaging "
                          "round, and the latest snapshot of each sync-mode DDP model")
    drain_grace: float = Field(5.0, ge=0)
    ha: str | None = Field(
        None, description="etcd://HOST:PORT[,HOST:PORT...][/PREFIX]: several coordinators, one "
                          "leader elected through an etcd lease, the others standing by "
                          "(gradstar.coordinator.leadership); ranks list every coordinator's "
                          "address in GRADSTAR_COORDINATOR")
    ha_ttl: int = Field(5, ge=2, le=300, description="seconds of the leader's etcd lease: a "
                                                     "leader that stops takes this long to "
                                                     "be replaced")
    ha_ca: Path | None = Field(
        None, description="the CA that signed etcd's certificate: the election talks to etcd "
                          "over TLS (https://), checking its certificate and host name")
    ha_cert: Path | None = Field(
        None, description="with ha_ca: this coordinator's certificate for etcd's "
                          "--client-cert-auth (PEM; the key in ha_key, or in this file)")
    ha_key: Path | None = Field(None, description="the private key of ha_cert (PEM)")
    ha_advertise: str | None = Field(
        None, description="the address ranks reach this coordinator at, as the election "
                          "publishes it (default: its host and port; a wildcard host: this "
                          "host's name)")
    measure_arrivals: bool = Field(
        True, description="time each rank's arrival at every collective (one timestamp per "
                          "rank; the stragglers views); off only to measure what it costs")
    metrics_port: int | None = Field(
        None, ge=0, le=65535,
        description="serve Prometheus metrics over HTTP on this port (0 picks a free one)")
    # Metrics name every job and rank and need no token: loopback unless an operator opens it.
    metrics_host: str = Field(
        "127.0.0.1", description="address the metrics endpoint binds; 0.0.0.0 for a scraper "
                                 "on another host")
    metrics_max_bytes: int = Field(
        1 << 20, ge=64 << 10,
        description="largest /metrics page; the series of jobs beyond it are left out and "
                    "counted in gradstar_metrics_jobs_omitted")
    reflection: bool = Field(
        False, description="register gRPC server reflection (service discovery for grpcurl "
                           "and the like; open without a token)")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING, ERROR or CRITICAL")
    insecure: bool = Field(
        False, description="serve on a non-loopback address without a job token or mutual TLS "
                           "(anyone who reaches the port may join jobs and call Admin)")
    job_retention: float = Field(
        600.0, ge=0, description="seconds a job with no live or joining member is kept (its "
                                 "state, counters and metric series) before it is dropped")
    max_jobs: int = Field(10_000, gt=0, description="jobs the coordinator holds at most; a new "
                                                    "job beyond it is refused")
    shards: int = Field(
        0, ge=0, le=64,
        description="data-plane shard processes to start on this host (gradstar coordinator "
                    "--shards); 0: the coordinator carries collectives itself unless shards "
                    "on other hosts register")
    expected_shards: int | None = Field(
        None, ge=0, le=64,
        description="shards (local and remote) that must be up for the coordinator to report "
                    "SERVING; default: --shards")
    shard_wait: float = Field(
        30.0, gt=0, description="seconds to wait for the expected shards at start")

    @field_validator("shards", "expected_shards", mode="before")
    @classmethod
    def _auto_shards(cls, value):
        return default_shard_count() if value == "auto" else value

    @field_validator("tls_key")
    @classmethod
    def _key_needs_cert(cls, value, info):
        if value is not None and info.data.get("tls_cert") is None:
            raise ValueError("tls_key needs tls_cert")
        return value

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        if value.upper() not in LOG_LEVELS:
            raise ValueError(f"should be one of {', '.join(LOG_LEVELS)}")
        return value.upper()

    def check_protected(self) -> None:
        """Refuse settings that would serve without protection by mistake, the way Redis'
        protected mode does: loopback without a token is fine for local use; any other address
        needs a job token or a job secret (or mutual TLS), or ``insecure`` said explicitly.

        Raises:
            ConfigurationError: a token is a placeholder from an example file, a job secret
                comes without an admin or shared token, or the server would listen on a
                non-loopback address unprotected without ``insecure``.
        """
        for secret, name in ((self.token, "job token (GRADSTAR_TOKEN)"),
                             (self.admin_token, "admin token (GRADSTAR_ADMIN_TOKEN)")):
            if secret is not None and is_placeholder_token(secret.get_secret_value()):
                raise ConfigurationError(
                    f"the {name} is a placeholder from an example, not a secret; set it to a "
                    "long random string, e.g. python3 -c 'import secrets; "
                    "print(secrets.token_urlsafe(32))'")
        if self.job_secret_file is not None and self.token is None and self.admin_token is None:
            raise ConfigurationError(
                "a job secret (GRADSTAR_JOB_SECRET_FILE) needs an admin token "
                "(GRADSTAR_ADMIN_TOKEN, --admin-token-file) or a shared job token too: without "
                "either, Admin calls (every job's views, drain) would be open to anyone, every "
                "job's ranks included")
        if (self.token is None and self.job_secret_file is None and self.tls_client_ca is None
                and not self.insecure and not is_loopback(self.host)):
            raise ConfigurationError(
                f"refusing to listen on {self.host or '0.0.0.0'} without a job token: anyone "
                "who reaches the port could join jobs and read their tensors; set "
                "GRADSTAR_TOKEN (or --token-file), or use --host 127.0.0.1 for this machine "
                "only, or pass --insecure to serve without authentication")


class ShardSettings(CoordinatorSettings):
    """``gradstar shard``: a data-plane shard that registers with a coordinator. It serves the
    Collective service with the same limits, tokens and TLS options as a coordinator."""

    coordinator: str = f"127.0.0.1:{DEFAULT_PORT}"
    port: int = Field(0, ge=0, le=65535)
    slot: int = Field(-1, ge=-1, description="the slot to ask for; -1: any free one")
    advertise_host: str | None = Field(
        None, description="host ranks reach this shard at; default: the bound host, or for a "
                          "wildcard this host's address toward the coordinator "
                          "(gradstar.transport.addresses); '' means 'the coordinator's host'")
    socket_ifname: str | None = Field(
        None, description="network interface whose IPv4 address the shard advertises")
    for_job: str = Field(
        "", max_length=256,
        description="serve only this job's generations (and its subgroups'): a node-local "
                    "shard; '' serves every job")
    coordinator_ca: Path | None = Field(
        None, description="CA bundle to verify the coordinator with (TLS to the coordinator)")
    outbound_only: bool = Field(
        False, description="this host takes no inbound connections from other hosts (behind "
                           "NAT, a firewall that only lets connections out): ranks on other "
                           "hosts reach the shard by NAT traversal (nat_traversal), else it "
                           "serves its own host's ranks only. Unset, the coordinator probes "
                           "the shard's address before it accepts it")
    nat_traversal: bool = Field(
        True, description="if this host turns out outbound-only, let ranks on other hosts "
                          "reach the shard through TCP hole punching, arranged by the "
                          "coordinator (gradstar.transport.traversal); off: the shard serves "
                          "its own host's ranks only, and their bytes across hosts go through "
                          "the reachable hosts' shards")


class ClientSettings(BaseSettings):
    """Defaults for :func:`gradstar.init_process_group`, from ``GRADSTAR_*`` env vars."""

    model_config = SettingsConfigDict(env_prefix="GRADSTAR_", extra="ignore")

    coordinator: str = f"127.0.0.1:{DEFAULT_PORT}"
    job: str = "default"
    world_size: int | None = Field(None, gt=0)
    rank: int | None = Field(None, ge=0)
    token: SecretStr | None = None
    token_file: Path | None = Field(
        None, description="file holding the job token, read when no token is given (a docker "
                          "or Kubernetes secret; keeps the token out of the environment)")
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    join_timeout: float = Field(300.0, gt=0)
    elastic: bool = Field(
        False, description="join in the place of a lost rank of the job's running generation "
                           "when there is one, instead of waiting for a new generation: for "
                           "restarted ranks of sync-mode DDP jobs (gradstar.sync_modes), whose "
                           "others go on without them; with no such place, and no rank given, "
                           "join it as one more rank while the job may grow (max_world_size)")
    max_world_size: int | None = Field(
        None, gt=0, description="the most ranks the job may grow to while it runs, by elastic "
                                "joins (as torchrun's --nnodes MIN:MAX): each one past the "
                                "world size ends the running generation's collectives, and "
                                "a sync-mode DDP's steps go on with the new rank; a "
                                "Synchronous DDP's job moves to a new generation at the next "
                                "step boundary instead")
    min_world_size: int | None = Field(
        None, gt=0, description="the fewest ranks the job may shrink to by departures "
                                "(DDP.leave(); as torchrun's --nnodes MIN:MAX): a departure "
                                "that would leave fewer is refused by name")
    timeout: float = Field(300.0, gt=0, description="default collective timeout in seconds")
    connect_timeout: float = Field(10.0, gt=0)
    connections: int = Field(
        0, ge=0, le=16,
        description="TCP connections to each hub shard and to the coordinator's collective "
                    "port for collectives' tensors; 0: chosen at join from the round trip "
                    "measured to each (1 on a LAN, more where one connection's window cannot "
                    "fill the path: docs/regions.md)")
    split_bytes: int = Field(
        32 << 20, ge=0,
        description="an all_reduce of at least this many bytes runs as up to 4 parts in "
                    "flight at once, which several connections carry side by side (every "
                    "rank must use the same value); 0: never split")
    reconnect_timeout: float = Field(
        30.0, ge=0, description="how long a rank whose coordinator went away (killed, "
                                "restarted, upgraded) keeps its state and tries to rejoin it "
                                "at the same address before its collectives fail with "
                                "CoordinatorLostError; 0: fail at once, and keep no copy of "
                                "collective inputs (docs/deployment.md, 'High availability')")
    chunk_bytes: int = Field(
        DEFAULT_CHUNK_BYTES, gt=0, le=MAX_CHUNK_BYTES,
        description="largest chunk of a collective (every rank the same); a striped one is "
                    "cut into at least 16 chunks a stripe (docs/performance.md, 'Fast links')")
    tune_allocator: bool = Field(
        True, description="raise glibc's mmap threshold so chunk buffers are reused "
                          "(see gradstar.allocator)")
    shared_memory: bool = Field(
        True, description="offer the hub shared memory for collective payloads; used only "
                          "when the hub is on this host and may map it "
                          "(see gradstar.transport.shm)")
    peer_host: str | None = Field(
        None, description="address the rank's peer server (send/recv, pipelines) binds; "
                          "advertised to the other ranks unless it is a wildcard. Default: "
                          "127.0.0.1 when the coordinator is on this host (a loopback "
                          "address), else every interface, advertised as this host's address "
                          "toward the coordinator (gradstar.transport.addresses)")
    advertise_host: str | None = Field(
        None, description="host the other ranks reach this rank's peer server at (NAT, a DNS "
                          "name); also what an env:// rank 0 advertises its hub at")
    socket_ifname: str | None = Field(
        None, description="network interface whose IPv4 address this rank advertises, as "
                          "GLOO_SOCKET_IFNAME does for gloo (several networks on one host)")
    peer_port: int = Field(0, ge=0, le=65535, description="peer server port; 0 picks a free one")
    outbound_only: bool = Field(
        False, description="this host takes no inbound connections from other hosts (behind "
                           "NAT, a firewall that only lets connections out): collectives "
                           "avoid its shard, and a send to this rank from another host fails "
                           "at once, naming why. Where a node-local shard runs, the "
                           "coordinator's probe of it says so without this")
    nat_traversal: bool = Field(
        True, description="reach ranks and hub shards on outbound-only hosts of other hosts "
                          "through TCP hole punching arranged by the coordinator "
                          "(gradstar.transport.traversal), and let them reach this rank so "
                          "where its host is outbound-only; off: peer streams to them go "
                          "through the coordinator's relay")
    hierarchical: bool = Field(
        True, description="all_reduce, broadcast, all_gather and reduce_scatter in two levels "
                          "when a generation spans hosts and some host runs several ranks: the "
                          "host's ranks combine on its node-local shard first, and only the "
                          "host's part crosses its link, once (gradstar.client.hierarchy)")
    straggler_log_seconds: float = Field(
        0.5, ge=0, description="log a line naming the ranks a collective waited this long for "
                               "(and their hosts); 0: never (gradstar.client.stragglers)")
    straggler_log_window: float = Field(
        60.0, ge=0, description="seconds between two such lines at least; the ones left out "
                                "are counted in the next")
    peer_buffer_messages: int = Field(
        64, gt=0, description="messages from one rank held before anybody receives them")
    peer_buffer_bytes: int = Field(
        256 << 20, ge=0, description="bytes from one rank held before anybody receives them; "
                                     "past either bound the sender is held back")

    def with_token(self) -> ClientSettings:
        """These settings, the token read from ``token_file`` when none is given (every client
        of the coordinator reads it alike: a process group, a Streaming DiLoCo replica).

        Raises:
            ConfigurationError: the token file cannot be read, or it is empty.
        """
        if self.token is not None or self.token_file is None:
            return self
        try:
            token = self.token_file.read_text(encoding="utf-8").strip()
        except OSError as error:
            raise ConfigurationError(f"cannot read the token file {self.token_file}: "
                                     f"{error.strerror}") from None
        if not token:  # an empty token would mean "no authentication": never by accident
            raise ConfigurationError(f"the token file {self.token_file} is empty")
        return self.model_copy(update={"token": SecretStr(token)})
