"""The distributed run's arithmetic in one process, and the saved rank states it starts from.

``gradstar demo`` has the ranks save their state every few steps (``--out``,
``--checkpoint-every``; :meth:`gradstar.worker.demo.modes.TrainingMode.save`), then replays each
stretch between two saves here and compares: see :mod:`gradstar.worker.demo.command`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .modes import MomentumSGD, sgd_step
from .spirals import flat_parameters, load_flat_parameters, make_model, make_spirals
from .train import TrainSettings, schedule_for

State = tuple[np.ndarray, np.ndarray]  # (flat parameters, flat momentum)


class SingleProcessRun:
    """What the ranks compute, in one process.

    ddp, fsdp and pipeline: one model trained on the whole global batch of every step (their
    ranks split the batch or the model, and must compute the same thing). localsgd: ``world``
    replicas, each on its slice, their parameters averaged after every ``sync_every``-th step
    and after the last. :meth:`load` starts it from saved states, so any stretch of a
    distributed run can be replayed.
    """

    def __init__(self, settings: TrainSettings, world: int) -> None:
        import torch

        torch.set_num_threads(1)
        self.settings = settings
        self.data = make_spirals(settings.samples, seed=settings.seed)
        self.schedule = schedule_for(settings, self.data, world)
        self.world = world
        self.replicas = world if settings.mode == "localsgd" else 1
        self.models = [make_model(self.data.features, self.data.classes, settings.hidden,
                                  seed=settings.seed) for _ in range(self.replicas)]
        self.opts = [MomentumSGD(m.parameters(), settings.lr, settings.momentum)
                     for m in self.models]
        if settings.mode == "localsgd":
            self._average()  # as LocalSGD's construction seeds the global model

    def load(self, states: list[State]) -> None:
        """Start from one ``(parameters, momentum)`` per replica."""
        for model, opt, (params, momentum) in zip(self.models, self.opts, states, strict=True):
            load_flat_parameters(model, params)
            opt.load_momentum(momentum)

    def run(self, start: int, stop: int) -> list[float]:
        """Train steps ``start`` to ``stop - 1`` of the schedule; return each step's training
        loss (localsgd: replica 0's, as its rank 0 reports)."""
        every, total = self.settings.sync_every, self.schedule.total_steps
        losses = []
        for step in range(start, stop):
            if self.replicas == 1:
                losses.append(sgd_step(self.models[0], self.opts[0], self.data,
                                       self.schedule.global_rows(step)))
                continue
            replicas = [sgd_step(m, opt, self.data, self.schedule.rank_rows(step, r))
                        for r, (m, opt) in enumerate(zip(self.models, self.opts, strict=True))]
            losses.append(replicas[0])
            if (step + 1) % every == 0 or step + 1 == total:
                self._average()
        return losses

    def parameters(self) -> list[np.ndarray]:
        return [flat_parameters(m) for m in self.models]

    def _average(self) -> None:
        mean = np.mean([flat_parameters(m) for m in self.models], axis=0, dtype=np.float32)
        for m in self.models:
            load_flat_parameters(m, mean)


def checkpoint_steps(out: Path) -> list[int]:
    """The steps after which rank 0 saved its state, in order."""
    return sorted(int(p.name[4:].partition("_")[0]) for p in out.glob("step*_rank0.*"))


def rank_states(out: Path, step: int, world: int) -> list[State]:
    """Each rank's own saved (parameters, momentum) after ``step`` (ddp, localsgd, pipeline)."""
    states = []
    for rank in range(world):
        with np.load(out / f"step{step}_rank{rank}.npz") as saved:
            states.append((saved["params"], saved["momentum"]))
    return states


def replica_states(out: Path, mode: str, step: int, world: int) -> list[State]:
    """The states :class:`SingleProcessRun` replays from, rebuilt from what the ranks saved:
    every rank's for localsgd, rank 0's for ddp, the merged shards for fsdp, the concatenated
    stages for pipeline."""
    if mode == "localsgd":
        return rank_states(out, step, world)
    if mode == "ddp":
        return rank_states(out, step, 1)
    if mode == "pipeline":
        stages = rank_states(out, step, world)
        return [(np.concatenate([p for p, _ in stages]), np.concatenate([m for _, m in stages]))]
    if mode == "fsdp":
        return [_merged_shards(out, step, world)]
    raise ValueError(f"unknown mode {mode!r}")


def _merged_shards(out: Path, step: int, world: int) -> State:
    import torch

    from gradstar.client.fsdp.state_dict import full_state_dict_from_shards

    saved = [torch.load(out / f"step{step}_rank{r}.pt", weights_only=True) for r in range(world)]
    flats = []
    for part in ("params", "momentum"):
        full = full_state_dict_from_shards([s[part] for s in saved])
        # The module's parameters in order: the keys of make_model's state dict.
        flats.append(torch.cat([full[name].reshape(-1) for name in _parameter_names()]).numpy())
    return flats[0], flats[1]


def _parameter_names() -> list[str]:
    model = make_model(2, 2, 1)
    return [name for name, _ in model.named_parameters()]
