"""The built-in training job: every rank trains the spirals MLP (DDP, LocalSGD, FSDP, Pipeline).

``python -m gradstar.worker.demo.train [--mode ddp|localsgd|fsdp|pipeline] [...]`` is what
``gradstar demo`` starts on each rank, what the docker-compose worker service runs under
``gradstar worker``, and a template for your own scripts under ``gradstar launch``. The process
group comes from the ``GRADSTAR_*`` env vars the launcher or agent sets; the job's settings from
flags or ``GRADSTAR_TRAIN_*`` env vars (``GRADSTAR_TRAIN_EPOCHS=3``, ...).

Data. Step ``s`` of the run uses the global batch ``s`` of a per-epoch permutation of the
training set; with DDP, LocalSGD and FSDP rank ``r`` of ``W`` takes the ``r``-th of its ``W``
equal slices, a pipeline takes it whole. So every mode computes what one process computes on
the whole global batch (LocalSGD: what ``W`` replicas averaged every few steps compute), and
:class:`gradstar.worker.demo.replay.SingleProcessRun` reproduces it in one process.
How each mode trains a step is in :mod:`gradstar.worker.demo.modes`.

Elasticity (what lets ``gradstar worker --max-restarts`` restart a dead rank; ddp and
localsgd, since a lost FSDP shard or pipeline stage cannot be recovered):

1. A rank joins the job and the ranks agree on where to resume: the largest *synced step*
   among them (a step whose gradients or parameters went through the hub on every rank; a
   collective either completes on every rank or on none, so survivors agree).
2. They agree on the state: with LocalSGD the ranks take the hub's global model (a restarted
   rank, like a fresh one, gets it while constructing ``LocalSGD``); with DDP the rank that is
   furthest ahead broadcasts its parameters and SGD momentum, so a restarted rank catches up.
3. They train from there. When a rank is lost (:class:`~gradstar.errors.RankLostError`), a
   collective times out or the coordinator goes away for a moment, every survivor closes its
   process group and goes back to 1; the rendezvous forms the next generation once the agent
   has restarted the dead rank. Errors that a new generation cannot fix (a wrong token, ranks
   disagreeing on a collective) end the process with exit code 1.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gradstar.errors import (
    CollectiveTimeoutError,
    ConfigurationError,
    CoordinatorUnavailableError,
    DuplicateRankError,
    GradstarError,
    JoinTimeoutError,
    RankLostError,
    RendezvousError,
)

from .modes import MODE_CLASSES, MomentumSGD
from .spirals import Spirals, make_model, make_spirals

MODES = ("ddp", "localsgd", "fsdp", "pipeline")

#: Exit code of a rank that could not train (bad settings or an unrecoverable gradstar error).
EXIT_FAILED = 1


class TrainSettings(BaseSettings):
    """The training job's settings: flags, else ``GRADSTAR_TRAIN_*`` env vars, else these."""

    model_config = SettingsConfigDict(env_prefix="GRADSTAR_TRAIN_", extra="ignore")

    mode: Literal["ddp", "localsgd", "fsdp", "pipeline"] = "ddp"
    epochs: int = Field(8, ge=1)
    batch_size: int = Field(64, ge=1, description="rows per rank and step")
    samples: int = Field(24_000, ge=12, description="dataset size (train + test)")
    hidden: int = Field(128, ge=1)
    lr: float = Field(0.1, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    sync_every: int = Field(4, ge=1, description="LocalSGD: optimizer steps between rounds")
    seed: int = 0
    out: Path | None = Field(None, description="directory for checkpoints and a summary")
    checkpoint_every: int = Field(
        0, ge=0, description="with out: save every rank's state every N steps (0: each epoch)")
    progress: Literal["text", "json", "none"] = "text"
    timeout: float = Field(120.0, gt=0, description="collective and join timeout, seconds")
    max_rejoins: int = Field(20, ge=0, description="generations a rank may re-join")

    @model_validator(mode="after")
    def _enough_data(self):
        if self.samples * 0.8 < self.batch_size:
            raise ValueError(f"{self.samples} samples leave fewer training rows than one "
                             f"batch of {self.batch_size}")
        return self


@dataclass(frozen=True)
class Schedule:
    """Which rows every step uses: a permutation per epoch, cut into global batches."""

    rows: int
    global_batch: int
    world: int
    epochs: int
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        return self.rows // self.global_batch

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.epochs

    def global_rows(self, step: int) -> np.ndarray:
        epoch, index = divmod(step, self.steps_per_epoch)
        return self._order(epoch)[index * self.global_batch:(index + 1) * self.global_batch]

    @functools.lru_cache(maxsize=2)  # noqa: B019  (a few small schedules per process)
    def _order(self, epoch: int) -> np.ndarray:
        return np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.rows)

    def rank_rows(self, step: int, rank: int) -> np.ndarray:
        per = self.global_batch // self.world
        return self.global_rows(step)[rank * per:(rank + 1) * per]


def schedule_for(settings: TrainSettings, data: Spirals, world: int) -> Schedule:
    global_batch = settings.batch_size * world
    if global_batch > len(data.train):
        raise ConfigurationError(f"a global batch of {global_batch} rows ({world} ranks x "
                                 f"{settings.batch_size}) is larger than the "
                                 f"{len(data.train)} training rows; lower --batch-size")
    return Schedule(len(data.train), global_batch, world, settings.epochs, settings.seed)


# -- progress output ---------------------------------------------------------------------------


class Progress:
    """What the reporting rank tells the outside: JSON events (for the demo) or log lines."""

    def __init__(self, style: str, enabled: bool) -> None:
        self.style = style if enabled else "none"
        self._last = 0.0

    def event(self, kind: str, text: str | None = None, **fields) -> None:
        if self.style == "json":
            print(json.dumps({"event": kind, **fields}), flush=True)
        elif self.style == "text" and text is not None:
            print(text, flush=True)

    def step(self, **fields) -> None:
        now = time.monotonic()
        if self.style == "json" and now - self._last >= 0.1:  # at most 10 updates a second
            self._last = now
            self.event("step", **fields)


# -- the elastic training loop -----------------------------------------------------------------


@dataclass
class RankState:
    """What a rank carries from one generation to the next."""

    model: object
    opt: object
    synced_step: int = 0
    generations: int = 0
    epoch_losses: list[float] = field(default_factory=list)


_REJOINABLE = (RankLostError, CollectiveTimeoutError, CoordinatorUnavailableError,
               DuplicateRankError, JoinTimeoutError)


def _rejoinable(error: GradstarError, settings: TrainSettings) -> bool:
    if not MODE_CLASSES[settings.mode].elastic:
        return False
    # A plain RendezvousError is "generation not current": a new generation formed meanwhile.
    return isinstance(error, _REJOINABLE) or type(error) is RendezvousError


def run_rank(settings: TrainSettings) -> int:
    """Train this rank to the end, re-joining after lost ranks; return the process exit code."""
    import torch

    import gradstar

    torch.set_num_threads(1)  # ranks share the host's cores with each other and the hub
    data = make_spirals(settings.samples, seed=settings.seed)
    model = make_model(data.features, data.classes, settings.hidden, seed=settings.seed)
    state = RankState(model, MomentumSGD(model.parameters(), settings.lr, settings.momentum))
    restart = int(os.environ.get("GRADSTAR_RESTART_COUNT", "0") or 0)
    failures = 0
    while True:
        try:
            with gradstar.init_process_group(timeout=settings.timeout,
                                             join_timeout=settings.timeout) as pg:
                state.generations += 1
                if _train_generation(pg, settings, data, state, restart):
                    return 0
        except GradstarError as error:
            if not _rejoinable(error, settings) or failures >= settings.max_rejoins:
                print(f"gradstar.worker.demo.train: {type(error).__name__}: {error}",
                      file=sys.stderr, flush=True)
                return EXIT_FAILED
            failures += 1
            print(f"gradstar.worker.demo.train: generation lost ({type(error).__name__}: {error}); "
                  f"re-joining (attempt {failures} of {settings.max_rejoins})", file=sys.stderr,
                  flush=True)
            time.sleep(min(0.2 * failures, 2.0))  # let the coordinator notice the lost rank


def _train_generation(pg, settings: TrainSettings, data: Spirals, state: RankState,
                      restart: int) -> bool:
    """One generation's share of the run; True once the run is complete."""
    schedule = schedule_for(settings, data, pg.world_size)
    steps = np.array([state.synced_step], dtype=np.int64)
    gathered = [int(s[0]) for s in pg.all_gather(steps)]
    start = max(gathered)
    mode = MODE_CLASSES[settings.mode](pg, state, settings, data, schedule,
                                       src=gathered.index(start))
    me = f"rank {pg.rank}"
    progress = Progress(settings.progress, pg.rank == mode.reporter)
    state.synced_step = start
    progress.event(
        "start", f"{me}: generation {pg.generation}, {pg.world_size} ranks, resuming at step "
                 f"{start} of {schedule.total_steps}" if start else
                 f"{me}: {settings.mode} on {pg.world_size} ranks, {settings.epochs} epochs of "
                 f"{schedule.steps_per_epoch} steps (global batch {schedule.global_batch})",
        mode=settings.mode, world_size=pg.world_size, generation=pg.generation,
        epochs=settings.epochs, steps_per_epoch=schedule.steps_per_epoch,
        global_batch=schedule.global_batch, start_step=start, restart=restart)
    total = schedule.total_steps
    every = settings.checkpoint_every or schedule.steps_per_epoch
    if settings.out is not None:
        settings.out.mkdir(parents=True, exist_ok=True)
        if start == 0:
            mode.save(settings.out, 0)
    began = epoch_began = time.monotonic()
    for step in range(start, total):
        loss, synced = mode.step(step)
        if synced:
            state.synced_step = step + 1
        if settings.out is not None and ((step + 1) % every == 0 or step + 1 == total):
            mode.save(settings.out, step + 1)
        if loss is not None:
            state.epoch_losses.append(loss)
        epoch, index = divmod(step, schedule.steps_per_epoch)
        if loss is not None:
            progress.step(epoch=epoch + 1, step=index + 1, loss=loss)
        if index + 1 == schedule.steps_per_epoch:
            test_acc = mode.test_accuracy()
            mean = float(np.mean(state.epoch_losses)) if state.epoch_losses else float("nan")
            state.epoch_losses.clear()
            seconds = time.monotonic() - epoch_began
            if test_acc is not None:
                progress.event(
                    "epoch", f"{me}: epoch {epoch + 1}/{settings.epochs}  loss {mean:.4f}  "
                             f"test accuracy {test_acc:.1%}  ({seconds:.1f} s)",
                    epoch=epoch + 1, loss=mean, test_accuracy=test_acc, seconds=seconds)
            epoch_began = time.monotonic()
    elapsed = time.monotonic() - began
    trained = total - start
    # Nobody leaves while another rank still needs the generation (a pipeline stage still
    # passing on the last micro-batches, say): leaving would fail it for them.
    pg.barrier()
    _write_summary(settings, pg, state, schedule, trained, elapsed)
    progress.event(
        "done", f"{me}: done, {trained * schedule.global_batch / max(elapsed, 1e-9):.0f} "
                f"samples/s over {elapsed:.1f} s",
        steps=trained, samples=trained * schedule.global_batch, seconds=elapsed,
        generations=state.generations)
    return True


def _write_summary(settings: TrainSettings, pg, state: RankState, schedule: Schedule,
                   steps: int, seconds: float) -> None:
    if settings.out is None:
        return
    # Every rank's bytes to and from the other ranks (a pipeline's activations and gradients).
    sent, received = pg.peer_bytes
    (settings.out / f"peer-{pg.rank}.json").write_text(json.dumps(
        {"rank": pg.rank, "bytes_sent": sent, "bytes_received": received}))
    if pg.rank != 0:
        return
    summary = {"mode": settings.mode, "world_size": pg.world_size, "steps": steps,
               "samples": steps * schedule.global_batch, "seconds": seconds,
               "generations": state.generations}
    (settings.out / "summary.json").write_text(json.dumps(summary))


def parse_settings(argv: list[str] | None = None) -> TrainSettings:
    parser = argparse.ArgumentParser(
        prog="python -m gradstar.worker.demo.train",
        description="Train the spirals MLP on this rank (settings: flags, else GRADSTAR_TRAIN_* "
                    "env vars; process group: GRADSTAR_* env vars).")
    parser.add_argument("--mode", choices=MODES)
    for name, kind in (("epochs", int), ("batch-size", int), ("samples", int), ("hidden", int),
                       ("lr", float), ("momentum", float), ("sync-every", int), ("seed", int),
                       ("timeout", float), ("max-rejoins", int), ("checkpoint-every", int)):
        parser.add_argument(f"--{name}", type=kind)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--progress", choices=("text", "json", "none"))
    args = parser.parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None}
    try:
        return TrainSettings(**given)
    except ValidationError as error:
        parser.error(str(error))
        raise  # unreachable: parser.error exits


def main(argv: list[str] | None = None) -> int:
    return run_rank(parse_settings(argv))


if __name__ == "__main__":
    raise SystemExit(main())
