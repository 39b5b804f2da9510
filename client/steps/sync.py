"""A DDP rank's steps in a sync mode other than Synchronous: contribute each gradient to the
hub's step ledger, and apply the hub's aggregates, in step order, with the user's optimizer.

How one training step runs (the loop stays ``zero_grad / forward / backward / opt.step()``):

1. ``loss.backward()`` ends: DDP calls :meth:`StepSync.contribute`; the rank's gradients (one
   flat float32 vector, with a weight) go to the hub, computed on the
   parameters after ``have`` aggregates. The hub answers which step they joined (or that they
   were dropped: computed on parameters the group has moved past) and, in the same answer,
   every aggregate closed after ``have``: one round trip per training step. The answer first
   waits until the step the gradient joined has closed (``SyncMode.waits_for_own_step``:
   Quorum, and BoundedStaleness and Asynchronous unless ``timeout=0``; the hub closes their
   steps at a deadline); with ``timeout=0`` those two never wait for it (a rank's next gradient
   closes its previous step on the hub; BoundedStaleness holds a fast rank's call only while a
   live rank would fall past the bound).
2. ``optimizer.step()`` is :meth:`StepSync.catch_up`: it applies the aggregates that answer
   brought, in order (fetching more only if the answer could not carry them all): their
   values into ``.grad``, then the optimizer's own ``step()``.
   Every rank applies the same aggregates in the same order with the same optimizer, so
   replicas stay bitwise identical whatever the mode.
3. :meth:`StepSync.synchronize` (every rank): a barrier on the hub; afterwards every rank has
   applied every aggregate of every contribution made before it.

With a wire format (DDP's ``wire=``) the gradient travels encoded and the aggregates come back
encoded (the hub encodes each once: every rank decodes the same bytes). With error feedback
(on by default with ``wire=``) the rank adds its residual ``e`` to the gradient, sends
``v = g + e`` and keeps ``e = v - roundtrip(v)``. **Drop rule**: a contribution the hub drops
(Quorum: stale; BoundedStaleness: over the bound) or refuses reached no aggregate, so the
residual goes back to what it was before it: the older residual carries on into the next
contribution and nothing of the dropped gradient leaks in. A contribution taken late (carried,
staleness > 0) did reach an aggregate: its residual stays. A rank that joins starts from a zero
residual (residuals are rank-local and never in a snapshot).

A heartbeat every second keeps the rank in the hub's live set while it computes; a rank that
dies or stalls leaves it and holds nobody. The calls run on the process group's loop thread but
use none of its collectives, so a failed generation never reaches them; nor does a coordinator
restart, when the group rides through those (:mod:`.riding`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import types
import weakref

import numpy as np
import torch

from gradstar.errors import (
    ConfigurationError,
    GradstarError,
    HubCapacityError,
    ProtocolError,
    StepError,
    StepMismatchError,
)
from gradstar.sync_modes import SyncMode, from_message
from gradstar.wire.formats import WireFormat

from ..error_feedback import ErrorFeedback
from .apply import catch_up_step, write_buffers, write_grads
from .client import POLL_SECONDS, StepsClient
from .hyper import read_hyper, write_hyper
from .riding import Held, StepsRide, dropped_by_restart
from .snapshot import pack, unpack
from .stats import ContributionEntry, StepEntry, SyncStats

log = logging.getLogger(__name__)

#: Seconds between heartbeats (the hub's lease is its heartbeat timeout, 15 s by default).
HEARTBEAT_SECONDS = 1.0
#: Aggregates per Fetch answer (a rank far behind asks again for the rest).
FETCH_LIMIT = 16
#: The key of a rank's contribution residual in its ErrorFeedback (the whole flat gradient).
RESIDUAL_KEY = "steps"
#: Answers that say the hub kept nothing of a contribution (the residual is restored).
REFUSED = (StepMismatchError, HubCapacityError, ProtocolError)


class StepSync:
    """Contributions and aggregates of one DDP model on one rank (see the module docstring).

    Args:
        params: the trainable parameters, in DDP's order (all ranks the same).
        optimizer: the user's torch optimizer over them; its ``step`` becomes :meth:`catch_up`.
        pg: the blocking process group (settings, rank, the hub's collective port, its loop;
            its timeout bounds a step or a barrier, then :class:`StepTimeoutError`).
        mode: the sync mode; ``model``: the ledger's name within the job.
        wire: the format contributions travel in (None: float32); ``feedback``: where the
            contribution residual lives (None: no error feedback).
        buffers: module buffers that travel after the gradient (DDP's ``broadcast_buffers``):
            each step's aggregate carries their weighted mean, which every rank writes into
            them as it applies the step (integers rounded), so they stay identical too.
    """

    def __init__(self, module: torch.nn.Module, params: list[torch.nn.Parameter],
                 optimizer: torch.optim.Optimizer, pg, mode: SyncMode, model: str,
                 wire: WireFormat | None = None, feedback: ErrorFeedback | None = None,
                 buffers: list[torch.Tensor] = ()) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigurationError(
                f"sync_mode={mode} needs optimizer=: the torch optimizer that trains the "
                "module (catching up means optimizer steps), not "
                f"{type(optimizer).__name__}")
        self.module = module
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.buffers = [b for b in buffers if b.dtype != torch.bool and not b.is_complex()]
        self.mode = mode
        self.mode_epoch = 0
        self.wire, self._feedback = wire, feedback
        self.timeout = pg.settings.timeout
        #: Aggregates applied to this rank's parameters.
        self.have = 0
        self.stats = SyncStats(str(mode), mode.scaling)
        self._joined: int | None = None  # step the pending contribution joined
        self._fetched = None  # the aggregates its answer brought, for catch_up
        self._pending = False
        self._barriers = 0
        self._in_barrier = False
        #: The pending contribution, kept to issue again after a coordinator restart.
        self._held: Held | None = None
        self._riding = StepsRide(pg, model)
        # Calls run on the process group's loop thread (grpc.aio binds a channel to the loop it
        # is made on, and serves one loop per process); closed with the group.
        self._submit = pg.submit
        self._client = self._run(_make_client(pg, model))
        self._beating = self._submit(self._beat())
        pg.on_close(self._close)
        self._optimizer = optimizer
        self._optimizer_step = None  # the optimizer's own step while attached
        self._attached_before = False
        self._snapshot_due = False  # the hub asked for this rank's state
        self._uploads: set = set()  # snapshot uploads in flight (kept until done)

    optimizer = property(lambda self: self._optimizer)
    #: How many times the ledger was resumed on a coordinator that took the job back.
    resumes = property(lambda self: self._riding.resumes)

    #: The synchronize() barriers this rank completed.
    barriers_done = property(lambda self: self._barriers - self._in_barrier)

    def attach(self, mode: SyncMode) -> None:
        """Take over ``optimizer.step`` (it applies the hub's aggregates) in ``mode``; the
        first ledger mode, or one after Synchronous steps (switched at a barrier)."""
        if self._optimizer_step is None:
            self._optimizer_step = self._optimizer.step
            scheduled = hasattr(self._optimizer_step, "_wrapped_by_lr_sched")
            self._optimizer.step = types.MethodType(
                catch_up_step(weakref.ref(self), scheduled), self._optimizer)
        if self._attached_before:
            self.set_mode(mode)  # every rank does: the same barrier on every rank
        self._attached_before = True

    def detach(self) -> None:
        """Give ``optimizer.step`` back (Synchronous steps from now on)."""
        if self._optimizer_step is not None:
            self._optimizer.step = self._optimizer_step
            self._optimizer_step = None

    # -- the training step -------------------------------------------------------------------

    def contribute(self, weight: float = 1.0) -> None:
        """Send the parameters' ``.grad`` (None: zeros) as this rank's contribution, of
        ``weight`` in its step's weighted mean.

        Raises:
            ConfigurationError: the previous contribution was not applied yet (call
                ``optimizer.step()`` between backward passes, or use ``no_sync()``).
            StepError and subclasses: the hub refused it or did not answer.
        """
        if self._pending:
            raise ConfigurationError(
                "this rank contributed a gradient that was not applied yet: call "
                "optimizer.step() after every synchronising backward pass (accumulate "
                "with ddp.no_sync())")
        flat = torch.cat([
            *((p.grad.detach().reshape(-1) if p.grad is not None
               else torch.zeros(p.numel(), device=p.device)).to(torch.float32)
              for p in self.params),
            *(b.detach().reshape(-1).to(torch.float32) for b in self.buffers)]).cpu()
        saved = self._compensate(flat)
        held = Held(flat.numpy(), self.have, weight,
                    tuple(v for _, _, v in read_hyper(self._optimizer)),
                    flat.shape[0] - self.numel)
        try:
            reply, self._fetched = self._send(held)
        except REFUSED:
            self._restore(saved)
            raise
        self.stats.waited_seconds += reply.waited_seconds  # the bound, or Quorum's step
        if not reply.accepted:
            self._restore(saved)
        self._held = held if reply.accepted else None
        self.stats.contributions += 1
        self.stats.recent_contributions.append(ContributionEntry(
            held.base, reply.step if reply.accepted else None, reply.staleness))
        self._pending = True
        self._snapshot_due |= reply.want_snapshot
        if reply.accepted:
            self.stats.accepted += 1
            self.stats.staleness[reply.staleness] += 1
            self._joined = reply.step
        else:
            self.stats.dropped += 1
            self._joined = None
            log.info("rank %d's gradient was dropped: %s", self._client.key.rank, reply.reason)

    def _send(self, held: Held):
        """Contribute ``held`` on this thread (its own channel): the verdict, and the
        aggregates the answer brought (with Quorum once its own step closed). After a restart,
        issued again only if computed at the resumed ledger's step count, else dropped."""
        def send():
            if self.have != held.base:  # it may be in a step some rank applied
                return dropped_by_restart(self.have, held.base), None
            return self._client.exchange_here(
                self.mode, self.mode_epoch, held.base, held.weight, held.flat, self.timeout,
                self.wire, fetch_limit=FETCH_LIMIT,
                await_step=POLL_SECONDS if self.mode.waits_for_own_step else 0.0,
                hyper=held.hyper, buffers=held.buffers)
        return self._riding_call(send)

    def _riding_call(self, call):
        """``call()``, again on the coordinator that took the job back (:mod:`.riding`)."""
        while True:
            if self._riding.moved:
                self._resume()
            try:
                return call()
            except GradstarError as error:
                if not self._riding.back(error):
                    raise
            self._resume()

    def _resume(self) -> None:
        """Resume the ledger on the coordinator that took the job back (:mod:`.riding`)."""
        self._client = self._riding.resume(self, self._client)

    def _reissue(self) -> int:
        """After a resume in :meth:`catch_up`: the step to wait for now; the pending
        contribution issued again if no rank applied its step (:meth:`_send`)."""
        held, joined = self._held, self._joined
        if held is None or (joined is not None and joined <= self.have):
            return 0
        reply, got = self._send(held)
        entry = self.stats.recent_contributions[-1]
        self.stats.recent_contributions[-1] = ContributionEntry(
            entry.base, reply.step if reply.accepted else None, reply.staleness)
        self._joined = reply.step if reply.accepted else None
        if got is not None:
            self._apply(got)
        return (self._joined or 0) if self.mode.waits_for_own_step else 0

    @property
    def residual(self) -> torch.Tensor | None:
        """What this rank's accepted contributions lost to the wire format so far (flat
        float32, DDP's parameter order; do not write); None without error feedback or before
        the first contribution."""
        return None if self._feedback is None else self._feedback.residuals.get(RESIDUAL_KEY)

    def _compensate(self, flat: torch.Tensor) -> torch.Tensor | None:
        """Add the residual to ``flat`` and keep what sending it loses; the residual before
        (None: none yet), for :meth:`_restore`."""
        if self._feedback is None:
            return None
        saved = self._feedback.save(RESIDUAL_KEY)
        offsets = np.cumsum([0] + [p.numel() for p in self.params])
        keep = [(int(offsets[i]), p.numel()) for i, p in enumerate(self.params)
                if p.grad is None]  # sent as zeros: its residual waits for a gradient
        self._feedback.compensate(RESIDUAL_KEY, flat, keep)
        return saved

    def _restore(self, saved: torch.Tensor | None) -> None:
        """The hub kept nothing of the contribution: its residual is the one before it."""
        if self._feedback is not None:
            self._feedback.restore(RESIDUAL_KEY, saved)

    def catch_up(self) -> None:
        """Apply the aggregates the last contribution's answer brought (in a mode that waits
        for its own step they include the step it joined); fetch only what that answer lacked
        (too many to carry, no answer yet, or its step still open: then wait for it).

        Raises:
            StepTimeoutError: the step did not close within the timeout.
            StepsBehindError: the hub no longer holds aggregates this rank needs.
        """
        wait_for = (self._joined if self.mode.waits_for_own_step else None) or 0
        got, self._fetched = self._fetched, None
        if got is not None:  # what the contribution's answer brought
            self._apply(got)
        if got is None or got.steps > self.have or wait_for > self.have:
            started = time.perf_counter()
            self._catch_up_to(wait_for)
            self.stats.waited_seconds += time.perf_counter() - started
        self._pending, self._joined, self._held = False, None, None
        if self._snapshot_due:
            self._send_snapshot()

    def join(self) -> None:
        """Start from the hub's state instead of rank 0's broadcast (a rank that joins
        mid-training, e.g. restarted by the agent): load the latest snapshot, then apply the
        aggregates closed after it. Nobody else waits for this.

        Raises:
            StepTimeoutError: the hub held no snapshot within the timeout.
            ProtocolError: the snapshot was malformed.
        """
        steps, layout, data = self._run(self._client.get_snapshot(self.timeout))
        unpack(layout, data, self.module, self._optimizer)
        # The ledger's switches and barriers before this process: its own count starts there.
        self.mode_epoch, self._barriers = self._client.mode_epoch, self._client.barriers
        self._restore(None)  # a joiner's residual starts at zero
        self.have = self.stats.step = steps
        self._catch_up_to(0)
        log.info("rank %d joined at step %d (snapshot of step %d)", self._client.key.rank,
                 self.have, steps)

    def hub_holds_snapshot(self) -> bool:
        """Whether the hub holds a snapshot of this model: the job trained before this
        process started (its ranks or the coordinator were restarted, or other ranks of this
        start already stepped), so a starting rank takes its state from there (:meth:`join`)."""
        return self._run(self._client.heartbeat(self.have, timeout=self.timeout)).has_snapshot

    def _send_snapshot(self) -> None:
        """Copy this rank's state now (at ``have`` aggregates) and send it in the background:
        training goes on meanwhile; a failed upload is logged, and the hub asks again. While
        an upload is still in flight the request waits (one upload at a time): the state goes
        at the first step after that upload is done. Dropped instead, it would leave the hub's
        snapshot a whole ``SNAPSHOT_EVERY`` steps staler, since the hub asks again only that
        many steps later (a slow disk on the hub made it keep a step-1 snapshot to step 20)."""
        if self._uploads:
            return
        self._snapshot_due = False
        layout, data = pack(self.module, self._optimizer)
        upload = self._submit(self._client.put_snapshot(self.have, layout, data, self.timeout))
        self._uploads.add(upload)

        def done(future) -> None:
            self._uploads.discard(future)
            if not future.cancelled() and future.exception() is not None:
                log.warning("a snapshot upload failed: %s", future.exception())

        upload.add_done_callback(done)

    def synchronize(self, next_mode: SyncMode | None = None) -> None:
        """Every live rank's contributions aggregated and applied (every rank calls it); with
        ``next_mode``, the ledger switches to it there, as every live rank asks.

        Raises:
            StepMismatchError: a switch was asked and the hub refused it (the ranks asked for
                different modes); the mode stays as it was.
        """
        self._barriers += 1
        self._in_barrier = True
        try:
            reply = self._riding_call(lambda: self._run(self._client.synchronize(
                self._barriers, self.timeout, next_mode)))
        finally:
            self._in_barrier = False
        if reply.steps > self.have:
            self._catch_up_to(reply.steps)
        self._pending, self._joined, self._fetched = False, None, None
        if next_mode is None:
            return
        if reply.switch_refused or not reply.HasField("mode") or (
                from_message(reply.mode) != next_mode):
            why = reply.switch_refused or "the hub kept its mode"
            raise StepMismatchError(
                f"set_sync_mode({next_mode}) was refused at barrier {self._barriers}: every "
                f"rank must switch to the same mode at the same step ({why}); the mode stays "
                f"{self.mode}")
        self.mode, self.mode_epoch = next_mode, reply.mode_epoch
        self.stats.mode, self.stats.scaling = str(next_mode), next_mode.scaling

    def set_mode(self, mode: SyncMode) -> None:
        """Switch at a barrier: every rank switches at the same step, at the epoch the hub
        hands out there."""
        self.synchronize(next_mode=mode)

    def _catch_up_to(self, min_steps: int) -> None:
        """Once ``min_steps`` steps closed, apply every closed aggregate, fetched
        ``FETCH_LIMIT`` at a time (a rank far behind gets many; each answer stays small)."""
        while True:
            if self._riding.moved:  # the coordinator came back meanwhile
                self._resume()
                min_steps = self._reissue()
            try:
                got = self._run(self._client.fetch(self.have, min_steps, self.timeout,
                                                   limit=FETCH_LIMIT))
            except GradstarError as error:
                if not self._riding.back(error):
                    raise
                self._resume()
                min_steps = self._reissue()
                continue
            self._apply(got)
            if got.steps <= self.have:
                return
            min_steps = 0

    def _apply(self, got) -> None:
        # Each step runs with its own hyperparameters; the rank's (its scheduler's) come back
        # after each, so they are read once here.
        own = read_hyper(self._optimizer)
        for record, values in zip(got.records, got.values, strict=True):
            if record.step != self.have + 1:
                raise StepError(f"the hub sent step {record.step} to a rank at step "
                                f"{self.have}; aggregates must be applied in order")
            write_grads(self.params, values)
            if len(record.hyper) == len(own):
                write_hyper(self._optimizer, own, record.hyper)
                self._optimizer_step()
                write_hyper(self._optimizer, own, [v for _, _, v in own])
            else:
                self._optimizer_step()
            write_buffers(self.buffers, values[self.numel:])
            self.have = self.stats.step = record.step
            self.stats.steps_applied += 1
            self.stats.step_sizes[len(record.ranks)] += 1
            self.stats.step_staleness.update(record.staleness)
            self.stats.recent_steps.append(StepEntry(
                record.step, tuple(record.ranks), tuple(record.weights),
                tuple(record.staleness), tuple(record.hyper), tuple(record.factors)))

    # -- plumbing ----------------------------------------------------------------------------

    def _run(self, coro):
        return self._submit(coro).result()

    async def _beat(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # a missed beat: the next one says it again
                state = await self._client.heartbeat(self.have)
                self.stats.live_ranks = tuple(state.live)
            await asyncio.sleep(HEARTBEAT_SECONDS)

    async def _close(self) -> None:
        """Leave the live set and close the channel (the group runs this as it closes)."""
        self._beating.cancel()
        with contextlib.suppress(Exception):
            await self._client.heartbeat(self.have, leave=True)
        await self._client.close()
        self.detach()


async def _make_client(pg, model: str) -> StepsClient:
    return StepsClient.for_group(pg, model)  # on the group's loop
