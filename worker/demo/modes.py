"""How each training mode runs a step on one rank, and what it saves for the replay check.

A mode wraps the rank's model for one generation, once the ranks agreed on the step to resume
from (:func:`gradstar.worker.demo.train.run_rank`). Every rank of a job runs the same mode and calls
the same methods in the same order, since most of them communicate:

- ``ddp``: :class:`gradstar.DDP`; each rank takes its slice of every global batch and the
  gradients are averaged at each step. Elastic: the rank furthest ahead gives its state.
- ``localsgd``: :class:`gradstar.LocalSGD`; slices as with DDP, parameters averaged through the
  hub's global model every ``sync_every`` steps and after the last. Elastic: every rank resumes
  from the global model.
- ``fsdp``: :class:`gradstar.FSDP`; slices as with DDP, each rank keeping 1/N of the parameters
  and momentum. Not elastic: a lost rank's shard is gone.
- ``pipeline``: :class:`gradstar.Pipeline`; rank r runs stage r of the MLP's layers on the
  whole global batch in ``world_size`` micro-batches. Not elastic: a lost stage is gone.

Saved states (``save(out, step)``, one file per rank) are what
:mod:`gradstar.worker.demo.replay` turns back into full parameters and momentum.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gradstar.errors import ConfigurationError

from .spirals import Spirals, evaluate, flat_parameters, load_flat_parameters, make_model


class MomentumSGD:
    """SGD with momentum by torch's own update (``torch.optim.sgd.sgd``, the function
    ``torch.optim.SGD.step`` runs), without the ``torch.optim.SGD`` class: constructing a torch
    optimizer imports ``torch._dynamo``, more than a second of CPU in every rank process, which
    a two-core machine running four ranks feels.

    The momentum buffers exist from the start (zeros): the first step then sets them to the
    gradient, exactly as torch's lazily created ones, and they can be saved and broadcast.
    """

    def __init__(self, params, lr: float, momentum: float) -> None:
        import torch

        self.params = list(params)
        self.lr = lr
        self.momentum_factor = momentum
        self.buffers = [torch.zeros_like(p) for p in self.params]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        import torch
        from torch.optim.sgd import sgd

        ready = [(p, b) for p, b in zip(self.params, self.buffers, strict=True)
                 if p.grad is not None]
        if not ready:
            return
        with torch.no_grad():
            sgd([p for p, _ in ready], [p.grad for p, _ in ready],
                [b if self.momentum_factor else None for _, b in ready],
                weight_decay=0.0, momentum=self.momentum_factor, lr=self.lr, dampening=0.0,
                nesterov=False, maximize=False)

    def momentum(self) -> np.ndarray:
        """The momentum buffers, flat, in parameter order (a copy)."""
        import torch

        with torch.no_grad():
            flat = [b.reshape(-1) for b in self.buffers]
            return torch.cat(flat).numpy().copy() if flat else np.empty(0, dtype=np.float32)

    def load_momentum(self, flat: np.ndarray) -> None:
        import torch

        offset = 0
        with torch.no_grad():
            for b in self.buffers:
                n = b.numel()
                b.copy_(torch.from_numpy(flat[offset:offset + n]).view_as(b))
                offset += n


class TrainingMode:
    """The part of a training run that depends on the mode; see the module docstring."""

    elastic = True

    def __init__(self, pg, state, settings, data: Spirals, schedule, src: int) -> None:
        self.pg, self.state, self.settings, self.data = pg, state, settings, data
        self.schedule = schedule
        self.rank = pg.rank

    @property
    def reporter(self) -> int:
        """The rank that has the loss and prints progress."""
        return 0

    def step(self, step: int) -> tuple[float | None, bool]:
        """Train global step ``step``: (this rank's loss or None, whether it was synchronised)."""
        raise NotImplementedError

    def test_accuracy(self) -> float | None:
        """Accuracy on the test split, on the reporting rank (every rank calls this)."""
        if self.rank != self.reporter:
            return None
        return evaluate(self.state.model, self.data.test)[1]

    def save(self, out: Path, step: int) -> None:
        """This rank's parameters and momentum after ``step`` steps."""
        np.savez(out / f"step{step}_rank{self.rank}.npz",
                 params=flat_parameters(self.state.model), momentum=self.state.opt.momentum())


class DDPMode(TrainingMode):
    def __init__(self, pg, state, settings, data, schedule, src) -> None:
        import gradstar

        super().__init__(pg, state, settings, data, schedule, src)
        if state.generations > 1:
            # The lost generation's wrapper keeps gradient hooks on the old tensors, and they
            # must not fire into its closed process group: continue in new ones.
            model = fresh_copy(state.model, settings, data)
            opt = MomentumSGD(model.parameters(), settings.lr, settings.momentum)
            opt.load_momentum(state.opt.momentum())
            state.model, state.opt = model, opt
        _adopt_state_of(pg, state, src)
        self.net = gradstar.DDP(state.model, pg)

    def step(self, step: int) -> tuple[float | None, bool]:
        rows = self.schedule.rank_rows(step, self.rank)
        return sgd_step(self.net, self.state.opt, self.data, rows), True


class LocalSGDMode(TrainingMode):
    def __init__(self, pg, state, settings, data, schedule, src) -> None:
        import gradstar

        super().__init__(pg, state, settings, data, schedule, src)
        # Every rank, restarted or not, takes the hub's global model (or rank 0's at the start).
        self.lsgd = gradstar.LocalSGD(state.model, pg, settings.sync_every)

    def step(self, step: int) -> tuple[float | None, bool]:
        rows = self.schedule.rank_rows(step, self.rank)
        loss = sgd_step(self.state.model, self.state.opt, self.data, rows)
        synced = self.lsgd.step()
        if not synced and step + 1 == self.schedule.total_steps:
            self.lsgd.sync()  # the final parameters are the global model, the same everywhere
            synced = True
        return loss, synced


class FSDPMode(TrainingMode):
    elastic = False

    def __init__(self, pg, state, settings, data, schedule, src) -> None:
        import gradstar

        super().__init__(pg, state, settings, data, schedule, src)
        self.net = gradstar.FSDP(state.model, pg)
        # The optimizer works on this rank's flat shards, so its momentum is sharded too.
        state.opt = MomentumSGD(self.net.parameters(), settings.lr, settings.momentum)

    def step(self, step: int) -> tuple[float | None, bool]:
        rows = self.schedule.rank_rows(step, self.rank)
        return sgd_step(self.net, self.state.opt, self.data, rows), True

    def test_accuracy(self) -> float | None:
        import torch

        with torch.no_grad():  # every rank gathers the units for this forward
            logits = self.net(torch.from_numpy(self.data.test.x))
        if self.rank != self.reporter:
            return None
        return (logits.argmax(dim=1).numpy() == self.data.test.y).mean().item()

    def save(self, out: Path, step: int) -> None:
        import torch

        opt = self.state.opt
        params = self.net.sharded_state_dict()
        # The momentum has the shards' layout: read it through the same sharded_state_dict by
        # swapping it into the shards for a moment.
        with torch.no_grad():
            kept = [p.detach().clone() for p in opt.params]
            for p, buffer in zip(opt.params, opt.buffers, strict=True):
                p.copy_(buffer)
            momentum = self.net.sharded_state_dict()
            for p, value in zip(opt.params, kept, strict=True):
                p.copy_(value)
        torch.save({"params": params, "momentum": momentum},
                   out / f"step{step}_rank{self.rank}.pt")


class PipelineMode(TrainingMode):
    elastic = False

    def __init__(self, pg, state, settings, data, schedule, src) -> None:
        import gradstar

        super().__init__(pg, state, settings, data, schedule, src)
        self.stage = pipeline_stage(state.model, pg.rank, pg.world_size)
        state.opt = MomentumSGD(self.stage.parameters(), settings.lr, settings.momentum)
        self.pipe = gradstar.Pipeline(self.stage, pg, num_microbatches=pg.world_size)

    @property
    def reporter(self) -> int:
        return self.pg.world_size - 1

    def step(self, step: int) -> tuple[float | None, bool]:
        import torch

        rows = self.schedule.global_rows(step)
        first, last = self.pipe.is_first, self.pipe.is_last
        x = torch.from_numpy(self.data.train.x[rows]) if first else None
        y = torch.from_numpy(self.data.train.y[rows]) if last else None
        self.state.opt.zero_grad()
        loss = self.pipe.step(x, y, torch.nn.functional.cross_entropy)
        self.state.opt.step()
        return (loss.item() if loss is not None else None), True

    def test_accuracy(self) -> float | None:
        import torch

        x = torch.from_numpy(self.data.test.x) if self.pipe.is_first else None
        with torch.no_grad():  # inference: keep nothing for a backward
            logits = self.pipe.forward(x)
        if logits is None:
            return None
        return (logits.argmax(dim=1).numpy() == self.data.test.y).mean().item()

    def save(self, out: Path, step: int) -> None:
        np.savez(out / f"step{step}_rank{self.rank}.npz", params=flat_parameters(self.stage),
                 momentum=self.state.opt.momentum())


MODE_CLASSES = {"ddp": DDPMode, "localsgd": LocalSGDMode, "fsdp": FSDPMode,
                "pipeline": PipelineMode}


def pipeline_stage(model, rank: int, world: int):
    """Layers ``rank`` of ``world`` contiguous, near-equal groups of the model's layers.

    Raises:
        ConfigurationError: more stages than layers.
    """
    from torch import nn

    layers = list(model)
    if world > len(layers):
        raise ConfigurationError(f"pipeline mode splits the {len(layers)} layers of the MLP "
                                 f"into stages, so it runs on at most {len(layers)} ranks, "
                                 f"not {world}")
    bounds = np.linspace(0, len(layers), world + 1).round().astype(int)
    return nn.Sequential(*layers[bounds[rank]:bounds[rank + 1]])


def sgd_step(model, opt, data: Spirals, rows: np.ndarray) -> float:
    """Forward, backward and optimizer step of ``model`` on training rows ``rows``."""
    import torch

    x = torch.from_numpy(data.train.x[rows])
    y = torch.from_numpy(data.train.y[rows])
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def _adopt_state_of(pg, state, src: int) -> None:
    """DDP: take rank ``src``'s parameters and momentum (every rank calls this)."""
    import torch

    tensors = [*state.model.parameters(), *state.opt.buffers]
    with torch.no_grad():
        flat = torch.cat([t.detach().reshape(-1) for t in tensors]).numpy()
        flat = pg.broadcast(flat, src=src)
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(torch.from_numpy(flat[offset:offset + n]).view_as(t))
            offset += n


def fresh_copy(model, settings, data: Spirals):
    """A new model holding ``model``'s parameter values, in new tensors."""
    copy = make_model(data.features, data.classes, settings.hidden, seed=settings.seed)
    load_flat_parameters(copy, flat_parameters(model))
    return copy
