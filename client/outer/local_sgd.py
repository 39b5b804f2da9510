"""LocalSGD and DiLoCo: ranks train on their own and meet every ``sync_every`` steps.

Between rounds each rank runs its inner optimizer alone; every ``sync_every`` calls of
:meth:`LocalSGD.step` the parameters are synchronised through the hub's global model:

- plain LocalSGD (``outer_optimizer=None``): parameters become the mean over ranks;
- DiLoCo (``outer_optimizer="nesterov"`` or ``"sgd"``): each rank sends its pseudo-gradient
  (global parameters at the last round minus its parameters now) and the hub applies the outer
  step to the global model once, keeping the outer momentum next to the model.

With ``wire=`` (DiLoCo only) the pseudo-gradients travel in a compressed wire format
(:mod:`gradstar.wire.formats`; Streaming DiLoCo ships them in 4 bits); the hub decodes them and
keeps the global model and the outer momentum in float32, and the ranks get float32 parameters
back (so no rank's model is ever rounded to the wire format). The seed round always travels in
float32.

Either way every rank ends the round with the identical new global parameters. At construction
the ranks take rank 0's parameters and then the job's global model if the hub already holds one,
so a rank that joins late or restarts after a failure resumes from the last completed round
(which the coordinator also persists with ``--state-dir``).

The job may grow and shrink while it trains (``GRADSTAR_MAX_WORLD_SIZE`` /
``GRADSTAR_MIN_WORLD_SIZE``): after each round the ranks cross a step boundary
(:mod:`gradstar.client.ddp.elastic`), where a rank that joined past the world size comes in,
receiving the global model, the round count and the step count from rank 0 (it starts from the
global model, as a DiLoCo replica does), and where a rank that called :meth:`LocalSGD.leave`
leaves: the others go on in the job's next generation, no process restarted. A join or a
departure takes effect at the boundary after the next round.

The module may live on the CPU or on one CUDA device: the flat float32 vectors of a round
(parameters, pseudo-gradients, the global parameters) are built and kept on that device, the
process group stages them through host memory, and the new parameters are written in place,
so the module never leaves its device.
"""

from __future__ import annotations

import numpy as np

from gradstar.errors import ConfigurationError, ProcessGroupClosedError, ProtocolError
from gradstar.wire.formats import wire_format

from ..process_group import ProcessGroup

_RULES = {None: "average", "sgd": "outer_sgd", "nesterov": "outer_nesterov"}


class LocalSGD:
    """Synchronises ``module``'s parameters every ``sync_every`` steps over ``pg``.

    Call :meth:`step` after every ``optimizer.step()``. Only parameters are synchronised
    (buffers such as BatchNorm statistics stay local), as in torch's PostLocalSGD. The
    module's parameters and buffers are all on the CPU or all on one CUDA device (``device``).

    Raises:
        ConfigurationError: invalid arguments, ``pg`` is not a blocking ProcessGroup, or the
            module is not an nn.Module on the CPU or one CUDA device (the device is named).
        CollectiveError and subclasses: a round failed (for example a rank was lost); the
            parameters are unchanged and the round can be retried with a new process group.
    """

    def __init__(self, module, pg: ProcessGroup, sync_every: int, *,
                 outer_optimizer: str | None = None, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, model_name: str = "global",
                 wire: str | None = None) -> None:
        if not isinstance(pg, ProcessGroup):
            raise ConfigurationError(
                "LocalSGD needs the blocking ProcessGroup from gradstar.init_process_group()"
            )
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ConfigurationError(f"sync_every must be a positive integer, got {sync_every!r}")
        if outer_optimizer not in _RULES:
            raise ConfigurationError(
                f"outer_optimizer must be None, 'sgd' or 'nesterov', got {outer_optimizer!r}"
            )
        if wire is not None:
            if outer_optimizer is None:
                raise ConfigurationError(
                    "wire= compresses DiLoCo's pseudo-gradients; plain LocalSGD averages "
                    "parameters, which travel in float32 (set outer_optimizer, or leave wire "
                    "unset)")
            wire_format(wire)  # an unknown name fails here, not at the first round
        # Imported here: gradstar.client imports this module, and numpy-only installs of
        # gradstar have no torch.
        from ..torch_common import module_device

        self.device = module_device("LocalSGD", module)
        self.module = module
        self.pg = pg
        self.sync_every = sync_every
        self.outer_optimizer = outer_optimizer
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.model_name = model_name
        self.wire = wire
        self.params = [p for p in module.parameters()]
        self.local_steps = 0
        self.rounds = 0
        self._left = False
        from ..ddp.elastic import ElasticSteps

        #: Step boundaries after each round: the job growing and shrinking while it trains.
        self.elastic = ElasticSteps(pg, _GlobalModelState(self), synchronous=True)
        if self.elastic.start_state():  # a newcomer: the global model came from rank 0
            # The others crossed their boundary again once in the new generation (another
            # resize may have named the same one): so does this rank, to count as they do.
            self._boundary()
        else:
            start = pg.broadcast(self._flatten(), src=0)
            self._anchor = pg.sync_global_model(start, model=model_name, rule="seed")
            self._load(self._anchor)
        self.elastic.declare()

    def step(self) -> bool:
        """Count one optimizer step; synchronise on every ``sync_every``-th. True if it did.

        Raises:
            ProcessGroupClosedError: this rank has :attr:`left` the job.
        """
        if self._left:
            raise ProcessGroupClosedError(
                f"rank {self.pg.rank} left the job at its step boundary (leave()): run no "
                "more steps, close the process group")
        self.local_steps += 1
        if self.local_steps % self.sync_every:
            return False
        self.sync()
        return True

    def sync(self) -> None:
        """Run one averaging round now (blocking)."""
        rule = _RULES[self.outer_optimizer]
        current = self._flatten()
        if self.outer_optimizer is None:
            sent = current
        else:
            sent = self._anchor - current
        new = self.pg.sync_global_model(sent, model=self.model_name, rule=rule,
                                        outer_lr=self.outer_lr,
                                        outer_momentum=self.outer_momentum, wire=self.wire)
        self._load(new)
        self._anchor = new
        self.rounds += 1
        self._boundary()

    def _boundary(self) -> None:
        """After a round: leave, if this rank asked to and its boundary came; else cross it
        (the job may resize there)."""
        if not self.elastic.enabled:
            return
        if self.elastic.left:
            self._left = True
            return
        self.elastic.cross()
        self.elastic.done()

    def leave(self) -> None:
        """Leave the job for good at the boundary after the next round every rank reaches
        (:meth:`ElasticSteps.leave`); train on until :attr:`left`, then close the group.

        Raises:
            ConfigurationError: the job would fall below its ``min_world_size``.
        """
        self.elastic.leave()

    @property
    def left(self) -> bool:
        """Whether this rank, after :meth:`leave`, reached the boundary it leaves at: stop
        training (no more :meth:`step`) and close the process group."""
        return self._left

    @property
    def global_parameters(self) -> np.ndarray:
        """The flat float32 global parameters after the last round (a host copy)."""
        return self._anchor.to("cpu", copy=True).numpy()

    def _flatten(self):
        """The parameters as one flat float32 tensor on the module's device (a new tensor)."""
        import torch

        with torch.no_grad():
            if not self.params:
                return torch.empty(0, dtype=torch.float32, device=self.device)
            return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    def _load(self, flat) -> None:
        """Write a flat float32 tensor (on the module's device) into the parameters."""
        import torch

        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(flat[offset:offset + n].view_as(p))
                offset += n


class _GlobalModelState:
    """What LocalSGD's newcomers receive at a resize (:class:`~gradstar.client.ddp.elastic.
    JoinState`): the global model after the round just done, and where the schedule is."""

    def __init__(self, owner: LocalSGD) -> None:
        self.owner = owner

    def send(self, pg) -> None:
        o = self.owner
        pg.broadcast(np.array([o._anchor.numel(), o.rounds, o.local_steps], dtype=np.int64),
                     src=0)
        pg.broadcast(o._anchor.to("cpu").numpy(), src=0)

    def receive(self, pg) -> None:
        import torch

        o = self.owner
        numel, rounds, steps = (int(v) for v in pg.broadcast(np.zeros(3, dtype=np.int64),
                                                               src=0))
        flat = pg.broadcast(np.zeros(numel, dtype=np.float32), src=0)
        own = sum(p.numel() for p in o.params)
        if numel != own:
            raise ProtocolError(
                f"the job's global model {o.model_name!r} has {numel} parameters and this "
                f"rank's module {own}: a newcomer must train the same model")
        o._anchor = torch.from_numpy(flat).to(o.device)
        o._load(o._anchor)
        o.rounds, o.local_steps = rounds, steps
