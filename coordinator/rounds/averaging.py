"""The averaging store: each job's global model, updated by averaging rounds and persisted.

An *averaging round* is an all_reduce(mean) of a flat float32 vector whose header carries an
:class:`AveragingSpec`. As each chunk's mean is ready, the hub applies the round's rule to the
matching slice of the global model and streams the *new global parameters* back instead of the
mean, so every rank ends the round with identical parameters and the outer optimizer step
happens exactly once, on the hub:

- ``SEED``: the job's global model if it has one (a joining or restarted rank resumes from it),
  else the mean of what the ranks sent, which becomes the global model.
- ``AVERAGE``: LocalSGD; the global model becomes the mean of the ranks' parameters.
- ``OUTER_SGD`` / ``OUTER_NESTEROV``: DiLoCo; ranks send pseudo-gradients
  (global parameters at the last round minus their parameters now), and the hub applies SGD with
  heavy-ball or Nesterov momentum to the global model. The momentum lives here, next to the
  model, so it survives rank restarts and is never applied twice.

Updates go to staging arrays and replace the model only when the round completes on every rank;
a failed round changes nothing. With a state directory, each completed round is written to
``<state_dir>/<job stem>/<model stem>.npz`` (temporary file, fsync, rename) before the ranks get
their END frame, so a coordinator restart loses no completed round. The stems come from
:func:`state_file_stem`, so no job or model name can reach outside the state directory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import string
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gradstar import ops
from gradstar.errors import InvalidCollectiveError
from gradstar.proto.v1 import collective_pb2 as pb

log = logging.getLogger(__name__)

#: Characters a state file stem keeps as they are; every other byte is written ``%XX``.
_READABLE = frozenset((string.ascii_letters + string.digits + "_-").encode())
#: Bytes of a name shown in its stem: with the hash, a stem stays far below 255 bytes.
_READABLE_BYTES = 40


def state_file_stem(name: str) -> str:
    """A file name for ``name`` that stays inside its directory and differs for every name.

    A readable prefix (the first bytes of the UTF-8 name, each byte outside ``[A-Za-z0-9_-]``
    written ``%XX``, so ``.``, ``/``, ``\\`` and NUL never survive) and 80 bits of the SHA-256
    of the exact name, which tells apart names that share a prefix or differ only after it.
    The stem is at most 141 characters and never starts with ``.`` (temporary files do).
    """
    raw = name.encode("utf-8", "surrogatepass")
    prefix = "".join(chr(b) if b in _READABLE else f"%{b:02X}" for b in raw[:_READABLE_BYTES])
    return f"{prefix or '_'}-{hashlib.sha256(raw).hexdigest()[:20]}"


def collective_id(gen, seq: int) -> str:
    """Which collective of which generation ``seq`` is, across coordinator restarts: its
    number, and a digest of its members' ids, which a generation rebuilt from its rejoining
    ranks keeps (:mod:`gradstar.coordinator.rendezvous.rebuild`) and a new one never has."""
    members = "\x00".join(sorted(m.member_id for m in gen.members.values()))
    return f"{gen.number}/{seq}/{hashlib.sha256(members.encode()).hexdigest()[:24]}"


@dataclass(eq=False)
class GlobalModel:
    """A job's global parameters (flat float32), the outer momentum, the rounds completed,
    which collective made it (:func:`collective_id`; empty: none, e.g. a Rounds service
    round), and the replicas whose contributions made it (a Rounds service round's; a
    coordinator restarted with the state directory expects them in its next round)."""

    params: np.ndarray
    momentum: np.ndarray | None
    rounds: int
    made_by: str = ""
    replicas: tuple[str, ...] = ()


class AveragingRound:
    """One round's staged update of a global model; ``commit()`` makes it the model."""

    def __init__(self, store: AveragingStore, key: tuple[str, str], spec: pb.AveragingSpec,
                 numel: int, model: GlobalModel | None, made_by: str = "") -> None:
        self.store, self.key, self.spec, self.model = store, key, spec, model
        self.made_by = made_by
        #: The replicas whose contributions this round combines (the Rounds service's).
        self.replicas: tuple[str, ...] = ()
        self.rule = spec.rule
        self.lr = np.float32(spec.outer_lr)
        self.mu = np.float32(spec.outer_momentum)
        # SEED on an existing model answers it unchanged: nothing to stage. So does the very
        # collective that made the model, issued again after a coordinator restart (its ranks
        # ride through: gradstar.client.reconnect): its outer step was taken once already.
        again = bool(made_by) and model is not None and model.made_by == made_by
        self.answer_existing = again or (model is not None and self.rule == pb.AVERAGING_RULE_SEED)
        self.staged = None if self.answer_existing else np.empty(numel, dtype=np.float32)
        uses_momentum = self.rule in (pb.AVERAGING_RULE_OUTER_SGD,
                                      pb.AVERAGING_RULE_OUTER_NESTEROV) and self.mu != 0
        self.staged_momentum = np.empty(numel, dtype=np.float32) if uses_momentum else None

    def apply(self, start: int, values: np.ndarray) -> None:
        """Turn the mean of elements ``start:start+len(values)`` into new global parameters."""
        stop = start + values.shape[0]
        if self.answer_existing:
            values[:] = self.model.params[start:stop]
            return
        if self.rule in (pb.AVERAGING_RULE_OUTER_SGD, pb.AVERAGING_RULE_OUTER_NESTEROV):
            old = self.model.params[start:stop]
            step = values
            if self.staged_momentum is not None:
                buf = self.staged_momentum[start:stop]
                previous = self.model.momentum
                if previous is None:
                    buf[:] = values
                else:
                    np.multiply(previous[start:stop], self.mu, out=buf)
                    buf += values
                if self.rule == pb.AVERAGING_RULE_OUTER_NESTEROV:
                    step = values + self.mu * buf
                else:
                    step = buf
            np.subtract(old, self.lr * step, out=values)
        self.staged[start:stop] = values

    def commit(self) -> GlobalModel:
        """Install the staged model (and persist it, when a state directory is set).

        Raises:
            OSError: the state directory could not be written; nothing was installed.
        """
        model = self.result()
        if model is not self.model:
            self.store.install(self.key, model)
        return model

    def result(self) -> GlobalModel:
        """The model this round makes, not yet installed."""
        if self.answer_existing:
            return self.model
        momentum = self.staged_momentum
        if momentum is None and self.model is not None and self.rule not in (
                pb.AVERAGING_RULE_SEED, pb.AVERAGING_RULE_AVERAGE):
            momentum = self.model.momentum
        rounds = 0 if self.model is None else self.model.rounds + 1
        return GlobalModel(self.staged, momentum, rounds, self.made_by, self.replicas)


class AveragingStore:
    """Global models by (job, model name), loaded from and saved to ``state_dir`` if given."""

    def __init__(self, state_dir: Path | None = None) -> None:
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self._models: dict[tuple[str, str], GlobalModel] = {}
        #: Asked before each file replaces its older one (raises to refuse): under ``--ha``,
        #: whether this coordinator still leads, so that a stale one never overwrites the
        #: shared state directory (gradstar.coordinator.leadership).
        self.guard: Callable[[], None] | None = None

    def get(self, job: str, name: str) -> GlobalModel | None:
        key = (job, name)
        if key not in self._models and self.state_dir is not None:
            path = self._path(key)
            if path.exists():
                self._models[key] = self._load(path)
                log.info("loaded global model %r of job %r (round %d) from %s",
                         name, job, self._models[key].rounds, path)
        return self._models.get(key)

    def models(self, job: str) -> dict[str, GlobalModel]:
        return {name: m for (j, name), m in self._models.items() if j == job}

    def forget(self, job: str) -> None:
        """Drop ``job``'s models from memory (the state directory keeps its files)."""
        for key in [k for k in self._models if k[0] == job]:
            del self._models[key]

    def open_round(self, job: str, spec: pb.AveragingSpec, numel: int, *,
                   made_by: str = "") -> AveragingRound:
        """Stage a round of ``spec.rule`` for a vector of ``numel`` float32 elements, carried by
        collective ``made_by`` (:func:`collective_id`; empty: none).

        Raises:
            InvalidCollectiveError: unknown rule, no global model to step, or a size that
                differs from the stored model's.
        """
        if spec.rule not in ops.RULE_NAMES:
            raise InvalidCollectiveError(f"unknown averaging rule {spec.rule}")
        if not spec.model:
            raise InvalidCollectiveError("an averaging round needs a model name")
        model = self.get(job, spec.model)
        if model is not None and model.params.shape[0] != numel:
            raise InvalidCollectiveError(
                f"global model {spec.model!r} of job {job!r} has {model.params.shape[0]} "
                f"parameters, but this round sends {numel}; use another model name for a "
                "different model"
            )
        if model is None and spec.rule in (pb.AVERAGING_RULE_OUTER_SGD,
                                           pb.AVERAGING_RULE_OUTER_NESTEROV):
            raise InvalidCollectiveError(
                f"job {job!r} has no global model {spec.model!r} to apply an outer step to; "
                "seed it first (gradstar.LocalSGD does at construction). A coordinator that "
                "restarted without --state-dir lost its global models: ranks cannot ride "
                "through its restart in outer rounds without one"
            )
        return AveragingRound(self, (job, spec.model), spec, numel, model, made_by)

    def install(self, key: tuple[str, str], model: GlobalModel, *, persist: bool = True) -> None:
        """Make ``model`` the global model of ``key``, saved first when there is a state
        directory and ``persist``.

        Raises:
            OSError: saving failed; the previous model stays installed.
        """
        if persist and self.state_dir is not None:
            self._save(self._path(key), model, self.guard)
        self._models[key] = model

    def _path(self, key: tuple[str, str]) -> Path:
        job, name = (state_file_stem(part) for part in key)
        return self.state_dir / job / f"{name}.npz"

    @staticmethod
    def _save(path: Path, model: GlobalModel, guard: Callable[[], None] | None) -> None:
        arrays = {"params": model.params, "rounds": np.array(model.rounds, dtype=np.int64),
                  "made_by": np.array(model.made_by)}
        if model.momentum is not None:
            arrays["momentum"] = model.momentum
        if model.replicas:
            arrays["replicas"] = np.array("\n".join(model.replicas))
        save_arrays(path, arrays, guard)

    @staticmethod
    def _load(path: Path) -> GlobalModel:
        with np.load(path, allow_pickle=False) as data:
            momentum = data["momentum"].astype(np.float32) if "momentum" in data else None
            made_by = str(data["made_by"]) if "made_by" in data else ""
            replicas = tuple(str(data["replicas"]).split("\n")) if "replicas" in data else ()
            return GlobalModel(data["params"].astype(np.float32), momentum, int(data["rounds"]),
                               made_by, replicas)


def save_arrays(path: Path, arrays: dict[str, np.ndarray],
                guard: Callable[[], None] | None = None) -> None:
    """Write ``arrays`` to ``path`` (npz, no pickle) so that a crash leaves the old file or the
    new one, never a torn one: a temporary file beside it, fsync, rename, fsync of the folder.
    ``guard()``, called just before the rename, may refuse it by raising.

    Raises:
        OSError: writing failed; the old file (if any) is untouched.
        What ``guard`` raises (NotLeaderError): the old file is untouched.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            np.savez(out, **arrays)
            out.flush()
            os.fsync(out.fileno())
        if guard is not None:
            guard()
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself must survive a crash
    finally:
        os.close(dir_fd)
