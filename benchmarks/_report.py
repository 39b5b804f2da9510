"""What a benchmark prints and writes, and the options every script shares.

* :func:`format_table`, :func:`fmt`, :func:`median`, :func:`per_gb`, :data:`MiB`: the tables
  and their figures.
* :func:`environment`: the versions, machine and load a run's figures belong to.
* :func:`add_run_arguments`, :func:`write_json`: the ``--timeout`` / ``--json`` options.
* :func:`run_configs`: named configurations run one after the other, failures collected.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from _processes import BenchmarkError, loadavg

MiB = 1 << 20


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def fmt(value, spec: str) -> str:
    """``value`` formatted with ``spec``, or ``-`` for None (a figure not measured)."""
    return "-" if value is None else format(value, spec)


def per_gb(seconds: float | None, gb_moved: float) -> float | None:
    """CPU seconds per GB moved, or None if either is unknown."""
    return None if seconds is None or not gb_moved else seconds / gb_moved


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table, right-aligned, with a rule under the header."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = [" | ".join(c.rjust(w) for c, w in zip(cells[0], widths, strict=True)),
           "-+-".join("-" * w for w in widths)]
    out += [" | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells[1:]]
    return "\n".join(out)


def git_commit() -> str | None:
    """The repository's commit, ``+dirty`` with uncommitted edits to the library itself (not to
    benchmarks/), or None outside a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        git = ["git", "-C", str(root)]
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5).stdout.strip() or None
        dirty = subprocess.run([*git, "status", "--porcelain", "--", "src", "client",
                                "coordinator", "worker", "protos"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        if commit and dirty:
            commit += "+dirty"
    except Exception:
        commit = None
    return commit


def environment() -> dict:
    """Versions (python, numpy, torch, gradstar), the machine and its load average now."""
    import numpy
    import torch

    import gradstar

    return {"python": platform.python_version(), "numpy": numpy.__version__,
            "torch": torch.__version__, "gradstar": gradstar.__version__,
            "cpus": os.cpu_count(), "machine": platform.machine(), "system": platform.system(),
            "loadavg_at_start": loadavg()}


def add_run_arguments(parser: argparse.ArgumentParser, *, timeout: float = 600.0) -> None:
    """The ``--timeout`` (seconds per configuration) and ``--json`` options."""
    parser.add_argument("--timeout", type=float, default=timeout,
                        help="seconds allowed per configuration")
    parser.add_argument("--json", type=Path, help="also write the results here")


def run_configs(configs: Sequence[tuple[str, Callable[[], list]]],
                check: Callable[[list, str], None] | None = None
                ) -> tuple[dict[str, list | None], list[tuple[str, str]]]:
    """Run each ``(name, run)`` of ``configs`` in turn; ``run()`` returns one result per rank,
    each with the step ``"times"``. ``check(results, name)`` vets every configuration but
    ``"local"`` (the one without communication). Prints rank 0's median step time (or FAILED) per
    configuration to stderr and returns ``(runs, failures)``: the results by name (None for a
    configuration that failed) and ``(name, error message)`` per failure."""
    runs: dict[str, list | None] = {}
    failures: list[tuple[str, str]] = []
    for name, run in configs:
        t0 = time.monotonic()
        try:
            results = run()
            if check is not None and name != "local":
                check(results, name)
            runs[name] = results
            print(f"  {name:20s} median {median(results[0]['times']) * 1e3:9.1f} ms/step "
                  f"({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)
        except BenchmarkError as error:
            runs[name] = None
            failures.append((name, str(error)))
            print(f"  {name:20s} FAILED", file=sys.stderr, flush=True)
    return runs, failures


def write_json(args: argparse.Namespace, benchmark: str, **payload: object) -> None:
    """Write ``{"benchmark", "args", **payload}`` to ``args.json`` (the parsed options)."""
    args.json.write_text(json.dumps({"benchmark": benchmark, "args": vars(args) | {
        "json": str(args.json)}, **payload}, indent=2) + "\n")


def finish(args: argparse.Namespace, benchmark: str, summary: object,
           failures: list[tuple[str, str]]) -> int:
    """A benchmark's last words: each failed configuration printed with its error, the summary
    written as JSON where ``--json`` asks (:func:`write_json`); the exit status (1: a failure)."""
    for name, error in failures:
        print(f"\nFAILED: {name}:\n{error}")
    if args.json:
        write_json(args, benchmark, results=summary)
    return 1 if failures else 0


__all__ = ["MiB", "add_run_arguments", "environment", "finish", "fmt", "format_table",
           "git_commit", "median", "per_gb", "run_configs", "write_json"]
