"""A hub found or made through torch's own store, for ``init_method="env://"`` with nothing set.

torchrun, Lightning and Accelerate give every rank a shared store (``env://``: MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE) and nothing else. When the gradstar backend is asked for the
default group and no coordinator is configured (no ``GRADSTAR_COORDINATOR``, no host in a
``gradstar://`` URL), the ranks agree on a hub through that store:

- rank 0 starts ``gradstar coordinator`` as a child Python process on a free port, with a
  fresh random job token in its environment, and publishes the hub's address, the token and a
  fresh job name in the store;
- every other rank waits for those keys (up to the group's timeout) and joins that hub.

The keys carry torchelastic's restart count, so a restarted round (every worker started again)
gets a new hub and a new job, never a stale one. The hub lives as long as rank 0's default
group: destroying it stops the hub (SIGTERM: it drains, then exits) without waiting for the
hub's process to end, which takes a few hundred milliseconds that ``destroy_process_group``
need not spend; rank 0's exit hook waits for it (:func:`reap_stopped`), and the hub exits by
itself if rank 0's process dies (Linux: a parent-death signal). It is a separate process
rather than a thread in rank 0, so it neither shares rank 0's interpreter lock nor brings the
hub's code into a training process. Starting it is most of the time rank 0 spends joining: a
Python interpreter that imports grpc, numpy and pydantic (0.6-1.2 s on the 2-core development
machine, more under load; benchmarks/join_leave.py); a coordinator that is already running
(``GRADSTAR_COORDINATOR``) saves it.

Where the hub listens: 127.0.0.1 when every rank is on this host (``LOCAL_WORLD_SIZE`` equals
the world size, as under ``torchrun --standalone``), else every interface, advertised as an
address the other hosts reach (:func:`gradstar.transport.addresses.advertised_host`):
``GRADSTAR_ADVERTISE_HOST``, else the IPv4 address of ``GRADSTAR_SOCKET_IFNAME``, else this
host's address on its route toward ``MASTER_ADDR`` (the store every rank reaches), never a bare
host name that another host may resolve to itself. ``GRADSTAR_SHARDS`` sets its shards
(default 0).

Multi-host (``LOCAL_WORLD_SIZE`` below the world size): each host's local rank 0 also starts a
node-local shard for the job before it joins (:mod:`gradstar.node_shard`), so the job's
collectives stripe over one shard per host instead of crossing rank 0's link; it stops with that
rank's default group, as the hub does. ``GRADSTAR_NODE_SHARD=0`` turns it off.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import uuid
from dataclasses import dataclass
from datetime import timedelta

from gradstar import node_shard, spawn
from gradstar.errors import ConfigurationError
from gradstar.transport.addresses import advertised_host

log = logging.getLogger(__name__)

#: How long rank 0 waits for its hub to print its address.
START_TIMEOUT = 60.0


@dataclass
class StoreHub:
    """Where the default group's hub is; ``process`` is set on rank 0, which owns it, and
    ``shard`` on each host's local rank 0 of a multi-host job (:mod:`gradstar.node_shard`)."""

    address: str
    token: str
    job: str
    process: subprocess.Popen | None = None
    shard: node_shard.NodeShard | None = None

    @property
    def owns_processes(self) -> bool:
        return self.process is not None or self.shard is not None

    def stop(self, timeout: float = 10.0, *, wait: bool = True) -> None:
        """Stop this rank's node shard and, on rank 0, the hub (each drains running calls
        first, then exits; killed if it has not exited ``timeout`` seconds later).
        ``wait=False`` returns at once and leaves the waiting to :func:`reap_stopped`.
        Idempotent."""
        shard, self.shard = self.shard, None
        if shard is not None:
            shard.stop(wait=wait)
        proc, self.process = self.process, None
        spawn.stop(proc, timeout, wait=wait)


#: Rank 0's exit hook waits for the hubs (and shards) stopped without waiting.
reap_stopped = spawn.reap_stopped


def _keys() -> tuple[str, str, str]:
    round_ = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"gradstar/hub/{round_}/"
    return prefix + "address", prefix + "token", prefix + "job"


def _multi_host(world_size: int) -> bool:
    """Whether the ranks span hosts: fewer of them on this one than in the world."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) < world_size


def _listen_host(world_size: int) -> tuple[str, str]:
    """(bind host, advertised host) for the hub: see "Where the hub listens" above."""
    if not _multi_host(world_size):
        return "127.0.0.1", "127.0.0.1"
    return "0.0.0.0", advertised_host(
        os.environ.get("MASTER_ADDR"), advertise=os.environ.get("GRADSTAR_ADVERTISE_HOST"),
        ifname=os.environ.get("GRADSTAR_SOCKET_IFNAME"))


def _start(world_size: int) -> StoreHub:
    bind, advertise = _listen_host(world_size)
    token = secrets.token_urlsafe(32)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSTAR_")}
    env.update(GRADSTAR_TOKEN=token, GRADSTAR_ADMIN_TOKEN=token)
    args = ["coordinator", "--host", bind, "--port", "0",
            "--shards", os.environ.get("GRADSTAR_SHARDS", "0"), "--log-level", "WARNING"]
    try:
        proc, line = spawn.start(args, env, "rank 0's gradstar coordinator", START_TIMEOUT)
    except ConfigurationError as error:
        raise ConfigurationError(f"{error}; set GRADSTAR_COORDINATOR to a running one") from None
    port = int(line.rsplit(":", 1)[1])
    job = f"torch-{uuid.uuid4().hex[:12]}"
    return StoreHub(f"{advertise}:{port}", token, job, proc)


def find_or_make(store, rank: int, world_size: int, timeout: timedelta) -> StoreHub:
    """The default group's hub, through torch's ``store`` (see the module docstring).

    Raises:
        ConfigurationError: rank 0 could not start its hub, or this rank found no hub in the
            store within ``timeout`` (naming what to set).
    """
    hub = _find_or_make(store, rank, world_size, timeout)
    if (_multi_host(world_size) and os.environ.get("LOCAL_RANK") == "0"
            and node_shard.wanted()):
        # Before this rank joins: the generation forms with this host's shard in its table.
        hub.shard = node_shard.start(hub.address, hub.job, hub.token)
    return hub


def _find_or_make(store, rank: int, world_size: int, timeout: timedelta) -> StoreHub:
    address_key, token_key, job_key = _keys()
    if rank == 0:
        hub = _start(world_size)
        store.set(token_key, hub.token)
        store.set(job_key, hub.job)
        store.set(address_key, hub.address)  # last: the others wait for this one
        log.info("rank 0 started a gradstar coordinator at %s for job %s", hub.address, hub.job)
        return hub
    try:
        store.wait([address_key], timeout)
    except RuntimeError as error:  # torch's store raises a plain RuntimeError on its timeout
        raise ConfigurationError(
            f"Timed out: rank {rank} found no gradstar coordinator in torch's store within "
            f"{timeout.total_seconds():g} s: rank 0 starts one when GRADSTAR_COORDINATOR is not "
            "set; is rank 0 running with backend='gradstar', or set GRADSTAR_COORDINATOR "
            f"({error})") from None
    return StoreHub(store.get(address_key).decode(), store.get(token_key).decode(),
                    store.get(job_key).decode())
