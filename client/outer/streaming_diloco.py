"""Streaming DiLoCo: fragments of the model synced on staggered schedules, with overlapped,
fault-tolerant outer rounds on the hub (Douillard et al., 2025).

Each replica trains alone. The model's parameters are cut into ``fragments`` (P) runs of
layers (:func:`.plan.split_fragments`); fragment ``p`` starts an outer round every
``sync_every`` (H) inner steps, at its own offset (:class:`.plan.Schedule`):

1. *start* (after inner step t): the pseudo-gradient ``anchor_p - theta_p`` (the global
   fragment this replica last merged minus its parameters now) goes to the hub in the
   background, and training goes on;
2. the hub closes the round with the replicas that contributed (a dead or stalled replica is
   dropped after ``round_timeout``; :mod:`gradstar.coordinator.rounds`), applies outer Nesterov
   (or SGD) to its float32 global fragment once, and persists it;
3. *merge* (after inner step t + ``delay``, tau): the new global fragment ``g`` is mixed in,
   ``theta_p = alpha * theta_p + (1 - alpha) * g``, and becomes ``anchor_p``.

A replica that starts or restarts mid-training seeds (or finds) each fragment on the hub,
takes the hub's current global model and round numbers, resumes the schedule where the latest
round started, and joins the next rounds: no checkpoint on disk is needed. A replica whose
contribution comes after its round closed is told so and merges the global fragment it fetches
instead (it takes part in the next round). No other replica's failure raises here.

Usable from a plain torch loop::

    sdl = gradstar.StreamingDiLoCo(model, sync_every=100, fragments=4, delay=5,
                                   coordinator="hub:29400", job="j", replica="r0")
    for x, y in data:
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        sdl.step()
    sdl.close()

``wire=`` sends the pseudo-gradients in a compressed wire format (``"bf16"``, ``"fp16"``,
``"int8"``, ``"int4"``: :mod:`gradstar.wire.formats`), as Streaming DiLoCo sends 4-bit outer
gradients: named in each contribution's header (``TensorHeader.wire_format``), decoded to
float32 on the hub, whose global fragments and outer optimizer stay float32; seeds and fetched
global fragments stay float32. No error feedback: what rounding loses of a round's
pseudo-gradient is not carried into the next (the paper's 4-bit rounds need none).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import socket
import time

import numpy as np

from gradstar.config import ClientSettings
from gradstar.errors import ConfigurationError
from gradstar.wire.formats import wire_format

from ..loop_thread import LoopThread
from .plan import Schedule, split_fragments
from .rounds import RoundPolicySpec, RoundsClient

log = logging.getLogger(__name__)


class StreamingDiLoCo:
    """Streaming DiLoCo for one replica; call :meth:`step` after every ``optimizer.step()``.

    Connection settings (``coordinator``, ``job``, ``token``, TLS) default to the ``GRADSTAR_*``
    environment like :func:`gradstar.init_process_group`; ``replica`` defaults to
    ``GRADSTAR_RANK`` when set (stable across the agent's restarts), else host and pid.

    Raises:
        ConfigurationError: invalid arguments, an unknown ``wire`` format, or a
            module not on the CPU or one CUDA device.
        RoundMismatchError: the hub holds this model with other fragment sizes.
        RoundTimeoutError: a round did not close within ``timeout`` (fewer than
            ``min_replicas`` replicas contributed), raised by the :meth:`step` that merges it.
        AuthenticationError: the coordinator refused the token.
    """

    def __init__(self, module, *, sync_every: int, fragments: int = 1, delay: int = 0,
                 alpha: float = 0.5, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, min_replicas: int = 1, round_timeout: float = 30.0,
                 timeout: float = 300.0, model_name: str = "global", replica: str | None = None,
                 wire=None, **settings) -> None:
        self.schedule = Schedule(sync_every, fragments, delay)
        if not 0.0 <= alpha <= 1.0:
            raise ConfigurationError(f"alpha must be in [0, 1], got {alpha!r}")
        if not isinstance(min_replicas, int) or min_replicas < 1:
            raise ConfigurationError(f"min_replicas must be a positive integer, got "
                                     f"{min_replicas!r}")
        if round_timeout <= 0 or timeout <= 0:
            raise ConfigurationError("round_timeout and timeout must be positive")
        #: The pseudo-gradients' wire format (None: raw float32); raises ConfigurationError
        #: for an unknown one, before anything is sent.
        self.wire = wire_format(wire) if wire is not None else None
        from ..torch_common import module_device  # torch only when this class is used

        self.device = module_device("StreamingDiLoCo", module)
        self.module = module
        self.alpha = float(alpha)
        self.timeout = float(timeout)
        self.model_name = model_name
        self.policy = RoundPolicySpec(float(outer_lr), float(outer_momentum), bool(nesterov),
                                      min_replicas, float(round_timeout))
        params = list(module.parameters())
        self.groups = [[params[i] for i in run]
                       for run in split_fragments([p.numel() for p in params], fragments)]
        client_settings = ClientSettings(
            **{k: v for k, v in settings.items() if v is not None}).with_token()
        self.replica = replica or _default_replica(client_settings)
        self._loop = LoopThread()
        self.client: RoundsClient | None = None
        self._pending: dict[int, tuple[object, int]] = {}
        #: Per fragment: the global fragment merged last, and its completed rounds.
        self.anchors: list[np.ndarray] = []
        self.rounds: list[int] = []
        #: Rounds this replica's contribution came too late for (it merged the global instead).
        self.late_rounds = 0
        try:
            # grpc.aio channels belong to the loop they are made on: make it on ours.
            self.client = self._run(_open_client(client_settings, self.replica))
            self._join()
        except BaseException:
            self.close()
            raise

    def _run(self, coro):
        return self._loop.submit(coro).result()

    def _join(self) -> None:
        """Seed or find every fragment; start from the hub's global model and schedule."""
        began = time.monotonic()
        flats = [self._flat(p) for p in range(len(self.groups))]

        async def seed_and_fetch(p: int):
            await self.client.seed(self.model_name, p, flats[p], self.timeout)
            return await self.client.fetch(self.model_name, p, 0, self.timeout)

        async def every_fragment():  # at once: one round trip's wait, not one per fragment
            return await asyncio.gather(*(seed_and_fetch(p) for p in range(len(flats))))

        for p, (rounds, glob) in enumerate(self._run(every_fragment())):
            self._load(p, glob)
            self.anchors.append(glob)
            self.rounds.append(rounds)
        self.local_steps = self.schedule.resume_step(self.rounds)
        #: The step at which this replica took up the schedule (0 for one there from the start).
        self.joined_at_step = self.local_steps
        #: Seconds the join took (seeding and fetching every fragment).
        self.join_seconds = time.monotonic() - began
        log.info("replica %r joined at step %d with rounds %s", self.replica, self.local_steps,
                 self.rounds)

    def step(self) -> list[int]:
        """Count one inner step; start and merge the rounds due now. The fragments started."""
        self.local_steps += 1
        started = self.schedule.starts(self.local_steps)
        for p in started:
            self._start(p)
        for p, (_, merge_at) in sorted(self._pending.items()):
            if merge_at <= self.local_steps:
                self._merge(p)
        return started

    def finish(self) -> None:
        """Merge every round still in flight (at the end of training)."""
        for p in sorted(self._pending):
            self._merge(p)

    def _start(self, p: int) -> None:
        if p in self._pending:  # cannot happen with delay < sync_every; merge it first
            self._merge(p)
        delta = self.anchors[p] - self._flat(p)
        future = self._loop.submit(self.client.round(self.model_name, p, self.rounds[p],
                                                     self.policy, delta, self.timeout,
                                                     self.wire))
        self._pending[p] = (future, self.local_steps + self.schedule.delay)

    def _merge(self, p: int) -> None:
        future, _ = self._pending.pop(p)
        accepted, rounds, glob = future.result()
        if not accepted:
            self.late_rounds += 1
            log.warning("replica %r: round %d of fragment %d closed without it; merging the "
                        "global fragment of round %d", self.replica, self.rounds[p], p, rounds)
        mixed = self.alpha * self._flat(p) + (1.0 - self.alpha) * glob if self.alpha else glob
        self._load(p, mixed.astype(np.float32, copy=False))
        self.anchors[p] = glob
        self.rounds[p] = rounds

    @property
    def global_parameters(self) -> np.ndarray:
        """The global model as of this replica's last merges, flat float32 (a copy)."""
        return np.concatenate(self.anchors) if self.anchors else np.empty(0, np.float32)

    @property
    def bytes_exchanged(self) -> int:
        """Payload bytes this replica sent to and received from the hub so far."""
        return self.client.bytes_sent + self.client.bytes_received

    def _flat(self, p: int) -> np.ndarray:
        """Fragment ``p``'s parameters as one flat float32 host array (a new array)."""
        import torch

        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1).float() for t in self.groups[p]])
            return flat.to("cpu").numpy().copy()

    def _load(self, p: int, flat: np.ndarray) -> None:
        import torch

        source = torch.from_numpy(np.ascontiguousarray(flat, dtype=np.float32))
        offset = 0
        with torch.no_grad():
            for t in self.groups[p]:
                n = t.numel()
                t.copy_(source[offset:offset + n].view_as(t))
                offset += n

    def leave(self) -> None:
        """Leave the job's rounds for good (a replica going away between steps, e.g. on a
        spot instance's notice): merge the rounds in flight, tell the hub, which stops
        waiting for this replica in its open rounds and expects it in no later one, then
        close. The other replicas go on at once instead of at the rounds' timeout.

        Raises:
            RoundTimeoutError, CoordinatorUnavailableError: as :meth:`finish` and the call.
        """
        self.finish()
        if self.client is not None:
            self._run(self.client.leave(self.timeout))
        self.close()

    def close(self) -> None:
        """Close the connection (rounds in flight are abandoned; the hub drops this replica
        from them at their deadline)."""
        loop, self._loop = getattr(self, "_loop", None), None
        if loop is None:
            return
        if getattr(self, "client", None) is not None:
            # A close that does not finish in time must not hold up (or mask) what led here.
            with contextlib.suppress(concurrent.futures.TimeoutError):
                loop.submit(self.client.close()).result(timeout=5)
        loop.stop()

    def __enter__(self) -> StreamingDiLoCo:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _open_client(settings: ClientSettings, replica: str) -> RoundsClient:
    return RoundsClient(settings, replica)


def _default_replica(settings: ClientSettings) -> str:
    if settings.rank is not None:
        return f"rank-{settings.rank}"
    return f"{socket.gethostname()}-{os.getpid()}"
