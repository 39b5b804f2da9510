"""How a rank program of the cluster tests reports a phase: ``OUT/PHASE-RANK.json``, written
whole (a temporary file renamed into place), so that :func:`tests.cluster.jobs.wait_reports`,
which reads a report as soon as its name appears, never reads half of one."""

from __future__ import annotations

import json
from pathlib import Path


def write_report(out: Path, phase: str, rank: int, data: dict) -> None:
    """Write ``data`` as ``out/PHASE-RANK.json`` atomically."""
    path = out / f"{phase}-{rank}.json"
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(data))
    partial.rename(path)
