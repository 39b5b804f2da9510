"""A communication hook that gives torch's own DistributedDataParallel over the gradstar backend
the Quorum sync mode: a step's buckets close with the first ``min_ranks`` ranks, and a rank
that is late gets the same mean as the others without holding them.

Registered like torch's own hooks::

    model = torch.nn.parallel.DistributedDataParallel(net)     # backend="gradstar"
    model.register_comm_hook(QuorumHookState(min_ranks=3, timeout=0.05), quorum_hook)

Each bucket is a ledger on the hub (``gradstar.coordinator.steps``; one per bucket index and
size, so torch's bucket rebuild after the first iteration starts fresh ledgers on every rank
alike). Every iteration a rank sends its bucket computed on its ``have``-th parameters and gets
back the aggregate of step ``have + 1`` — the mean of the first ``min_ranks`` current
gradients, its own among them if it was in time, dropped if the others had moved on. Every rank
applies aggregates 1, 2, 3, ... one per iteration with its own optimizer, so replicas stay
identical and nobody waits for a late rank.

Where it differs from ``gradstar.DDP(sync_mode=Quorum(...))``: torch's DDP steps its optimizer
once per backward, so a rank applies one aggregate per iteration and cannot catch up faster; a
rank that is *always* slower falls further behind the quorum (its gradients all dropped) until
it needs an aggregate the hub no longer holds (:class:`~gradstar.errors.StepsBehindError`, after
64 steps). For persistent stragglers use ``gradstar.DDP``, whose ``optimizer.step()`` applies
every aggregate it missed.
"""

# No ``from __future__ import annotations``: torch's register_comm_hook compares the hook's
# annotations with dist.GradBucket and Future[Tensor] as objects, and refuses strings.
import concurrent.futures

import torch
import torch.distributed as dist

from gradstar.errors import ConfigurationError
from gradstar.sync_modes import Quorum

from ..steps.client import StepsClient
from .group import ProcessGroupGradstar


class QuorumHookState:
    """The state of :func:`quorum_hook`: the mode, each bucket's ledger and step count.

    Args:
        min_ranks, timeout: the Quorum (see :class:`gradstar.Quorum`).
        process_group: the gradstar torch group; None: the default group.

    Raises:
        ConfigurationError: ``min_ranks`` or ``timeout`` out of range.
    """

    def __init__(self, min_ranks: int, timeout: float = 0.0,
                 process_group: ProcessGroupGradstar | None = None) -> None:
        self.mode = Quorum(min_ranks=min_ranks, timeout=timeout)
        self.process_group = process_group
        #: Aggregates applied per ledger ((bucket index, size) -> count).
        self.have: dict[tuple[int, int], int] = {}
        #: This rank's buckets dropped as late, and sent in all.
        self.dropped = 0
        self.sent = 0
        self._clients: dict[tuple[int, int], StepsClient] = {}

    def group(self) -> ProcessGroupGradstar:
        group = self.process_group or dist.distributed_c10d._get_default_group()
        if not isinstance(group, ProcessGroupGradstar):
            raise ConfigurationError(
                "quorum_hook needs a process group of the gradstar backend "
                f"(dist.init_process_group(backend='gradstar')), got {type(group).__name__}: "
                "only gradstar's hub closes steps with a quorum")
        return group

    def close(self) -> None:
        """Close the ledgers' channels now (else the process group does as it closes)."""
        if self._clients:
            self.group().gradstar_group.submit(self._close()).result(timeout=10)

    async def _close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()

    def _client(self, key: tuple[int, int]) -> StepsClient:
        client = self._clients.get(key)
        if client is None:
            pg = self.group().gradstar_group
            if not self._clients:
                pg.on_close(self._close)
            # Made on the group's loop: grpc.aio binds a channel to the loop it is made on.
            client = self._clients[key] = pg.submit(_make_client(
                pg, f"torch-ddp-bucket-{key[0]}-{key[1]}")).result()
        return client

    async def _round(self, client: StepsClient, key: tuple[int, int], grad) -> torch.Tensor:
        have = self.have.get(key, 0)
        timeout = self.group().gradstar_group.settings.timeout
        reply = await client.contribute(self.mode, 0, have, 1.0, grad, timeout)
        self.sent += 1
        self.dropped += not reply.accepted
        got = await client.fetch(have, have + 1, timeout, limit=1)
        self.have[key] = have + 1
        return torch.from_numpy(got.values[0].copy())


def quorum_hook(state: QuorumHookState,
                bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Send ``bucket`` to its ledger and return the future of the step's mean (every rank the
    same), in the bucket's dtype and device.

    Raises:
        ConfigurationError: not a gradstar group.
    """
    buffer = bucket.buffer()
    key = (bucket.index(), buffer.numel())
    client = state._client(key)
    grad = buffer.detach().to(torch.float32).reshape(-1).cpu().numpy()
    out: torch.futures.Future = torch.futures.Future()
    work = state.group().gradstar_group.submit(state._round(client, key, grad))

    def done(f: concurrent.futures.Future) -> None:
        if f.exception() is not None:
            out.set_exception(f.exception())
        else:
            out.set_result(f.result().to(device=buffer.device, dtype=buffer.dtype))

    work.add_done_callback(done)
    return out


async def _make_client(pg, model: str) -> StepsClient:
    return StepsClient.for_group(pg, model)  # on the thread's loop: grpc.aio binds a channel


__all__ = ["QuorumHookState", "quorum_hook"]
