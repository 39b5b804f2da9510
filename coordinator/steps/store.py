"""The step ledgers' snapshots on disk (``gradstar coordinator --state-dir DIR``).

Each ledger's latest snapshot (a rank's module and optimizer state after some number of
aggregates, opaque to the hub) is written to ``DIR/steps/<job stem>/<model stem>.npz`` when the
hub takes it: a temporary file, fsync, rename (:func:`~..rounds.averaging.save_arrays`), three
arrays and no pickle. After a coordinator restart, a ledger made for that (job, model) starts at
the snapshot's step count with the snapshot in it, so the restarted ranks resume from it
(``gradstar.DDP`` in a sync mode loads it instead of broadcasting rank 0's parameters) instead
of from scratch: at most ``SNAPSHOT_EVERY`` steps are lost, never a torn or mixed state. The stems
come from :func:`~..rounds.averaging.state_file_stem`, so no job or model name reaches outside
the folder.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..rounds.averaging import save_arrays, state_file_stem
from .records import Snapshot

log = logging.getLogger(__name__)


class SnapshotStore:
    """Snapshots by (job, model) under ``state_dir / "steps"``."""

    def __init__(self, state_dir: Path) -> None:
        self.root = Path(state_dir) / "steps"
        #: Asked before a file replaces its older one: AveragingStore.guard.
        self.guard: Callable[[], None] | None = None

    def save(self, job: str, model: str, snapshot: Snapshot) -> None:
        """Write ``snapshot`` as (job, model)'s, replacing the older one whole.

        Raises:
            OSError: writing failed; the older file stays.
        """
        save_arrays(self.path(job, model), {
            "steps": np.array(snapshot.steps, dtype=np.int64),
            "layout": np.frombuffer(snapshot.layout.encode("utf-8"), dtype=np.uint8),
            "data": np.frombuffer(snapshot.data, dtype=np.uint8),
        }, self.guard)

    def load(self, job: str, model: str) -> Snapshot | None:
        """(job, model)'s saved snapshot, or None (none saved, or unreadable: logged)."""
        path = self.path(job, model)
        if not path.exists():
            return None
        try:
            with np.load(path, allow_pickle=False) as saved:
                snapshot = Snapshot(int(saved["steps"]),
                                    saved["layout"].tobytes().decode("utf-8"),
                                    saved["data"].tobytes())
        except (OSError, ValueError, KeyError, UnicodeDecodeError) as error:
            log.error("cannot read the snapshot of model %r of job %r from %s (%s); its ranks "
                      "start without it", model, job, path, error)
            return None
        log.info("loaded the snapshot of model %r of job %r (after %d aggregates) from %s",
                 model, job, snapshot.steps, path)
        return snapshot

    def path(self, job: str, model: str) -> Path:
        return self.root / state_file_stem(job) / f"{state_file_stem(model)}.npz"
