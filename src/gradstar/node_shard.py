"""The node-local shard: one hub shard on each host that runs ranks of a multi-host job.

Across hosts the cost is bytes on links (DESIGN.md, "Across hosts"). With the coordinator alone
carrying collectives, every rank's bytes cross the coordinator host's link: n·S each way for an
all_reduce of S bytes over n hosts. With one shard on each rank's host, registered for the job
(``gradstar shard --for-job JOB``), the generation stripes over exactly those shards: a rank
hands its own host's stripe to the shard beside it over shared memory and sends the other
stripes to the other hosts' shards, so each host link carries about 2(n-1)/n·S each way, what
a ring carries.

Whatever starts the ranks on a host starts it: the env:// drop-in's local rank 0 (torchrun,
Lightning), the worker agent, ``gradstar launch --coordinator``. ``GRADSTAR_NODE_SHARD=0``
turns it off. The shard registers for its job with the job token, as the job's ranks hold it
(``ShardControl.RegisterForJob``: a shard that carries only the job's generations sees nothing
a rank of the job cannot), so a coordinator with an admin token of its own takes it too.
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from gradstar import spawn
from gradstar.errors import ConfigurationError

log = logging.getLogger(__name__)

#: A job name ending in this and a host key (gradstar.transport.shm.host_key) is a per-host
#: group of the two-level all_reduce (gradstar.client.hierarchy): its generations stripe over
#: the job's node-local shard on that host alone.
HOST_GROUP = "/host-"
#: How long starting the shard and registering it may take (a Python start-up: ~1 s idle).
START_TIMEOUT = 60.0
#: Variables of the starter's environment the shard keeps (tokens, TLS, how to advertise).
_TOKENS = ("GRADSTAR_TOKEN", "GRADSTAR_TOKEN_FILE", "GRADSTAR_ADMIN_TOKEN",
           "GRADSTAR_ADMIN_TOKEN_FILE")
_KEPT = (*_TOKENS, "GRADSTAR_SOCKET_IFNAME", "GRADSTAR_ADVERTISE_HOST", "GRADSTAR_INSECURE",
         "GRADSTAR_OUTBOUND_ONLY", "GRADSTAR_NAT_TRAVERSAL")


def wanted() -> bool:
    """Whether node-local shards are on (``GRADSTAR_NODE_SHARD``, default on)."""
    return os.environ.get("GRADSTAR_NODE_SHARD", "1").strip().lower() not in ("0", "false",
                                                                              "no", "off")


@dataclass
class NodeShard:
    """A started node-local shard: its process and the address it advertised."""

    process: subprocess.Popen
    address: str

    def stop(self, *, wait: bool = True) -> None:
        spawn.stop(self.process, wait=wait)


@dataclass(frozen=True)
class ShardTLS:
    """How a node-local shard of a TLS job serves: its server certificate for this host, the
    CA that verifies the coordinator, and whether ranks present client certificates (mutual
    TLS: the shard then asks for them, chained to the same CA, and presents its certificate to
    the coordinator as a client, as a rank does)."""

    cert: Path
    key: Path
    ca: Path | None
    mutual: bool = False

    def args(self) -> list[str]:
        args = ["--tls-cert", str(self.cert), "--tls-key", str(self.key)]
        if self.ca is not None:
            args += ["--coordinator-ca", str(self.ca)]
            if self.mutual:
                args += ["--tls-client-ca", str(self.ca)]
        return args


def start(coordinator: str, job: str, token: str | None = None,
          tls: ShardTLS | None = None) -> NodeShard | None:
    """Start this host's shard for ``job`` (over TLS with ``tls``) and wait until the
    coordinator registered it; None (logged as a warning naming the cause) when it could not
    start or register: the job then runs on the shards it has, only slower across hosts."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GRADSTAR_") or k in _KEPT}
    if token is not None:
        env["GRADSTAR_TOKEN"] = token
    args = ["shard", "--coordinator", coordinator, "--host", "0.0.0.0", "--port", "0",
            "--for-job", job, "--log-level", "WARNING", *(tls.args() if tls else ())]
    if not any(env.get(k) for k in _TOKENS):
        args.append("--insecure")  # a job without a token: its shard is as open as its hub
    try:
        process, line = spawn.start(args, env, "this host's node-local gradstar shard",
                                    START_TIMEOUT)
    except ConfigurationError as error:
        log.warning("%s; job %r goes on without a shard on this host (set GRADSTAR_NODE_SHARD=0 "
                    "to not try)", error, job)
        return None
    address = line.rsplit("advertised as ", 1)[-1].rstrip(")")
    log.info("node-local shard for job %r at %s", job, address)
    return NodeShard(process, address)


__all__ = ["HOST_GROUP", "START_TIMEOUT", "NodeShard", "ShardTLS", "start", "wanted"]
