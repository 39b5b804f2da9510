"""Shared machinery for the scripts in ``benchmarks/``: the index of the harness.

Each part is a module of its own, every name re-exported here (``from _harness import X``):

* :mod:`_processes`: the processes a benchmark starts (:class:`CoordinatorProcess`, a real
  ``gradstar coordinator`` subprocess whose CPU is read from /proc), and how none of them
  outlives it; :class:`BenchmarkError`, :func:`free_port`, :func:`loadavg`,
  :func:`cpu_seconds_of`.
* :mod:`_ranks`: :func:`run_ranks` (a function in N spawned processes, one result per rank,
  with a hard deadline, :class:`RankFailure`) and :class:`DriverSync` (ranks held at chosen
  points until this process has acted, e.g. sampled the hub's CPU).
* :mod:`_paths`: the data paths (:data:`PATHS`: shared memory or the gRPC stream), set with
  :func:`path_env`, reported by :func:`shm_report`, checked by :func:`check_path`.
* :mod:`_report`: tables (:func:`format_table`), figures (:func:`median`), :func:`environment`,
  the ``--timeout`` / ``--json`` options, :func:`run_configs` and a run's end (:func:`finish`).
* :mod:`_collective_runs`: a timed collective against a fresh hub, its CPU sampled around the
  ranks' timed loop (``allreduce.py``, ``gpu.py``).

Every wait in them is bounded; nothing can hang a benchmark run.
"""

from __future__ import annotations

from _paths import PATHS, add_paths_argument, check_path, path_env, shm_report
from _processes import (
    BenchmarkError,
    CoordinatorProcess,
    cpu_seconds_of,
    descendants,
    free_port,
    loadavg,
)
from _ranks import DriverSync, RankFailure, SyncPoints, run_ranks
from _report import MiB, add_run_arguments, finish, format_table, median, run_configs, write_json

__all__ = [
    "PATHS",
    "BenchmarkError",
    "CoordinatorProcess",
    "DriverSync",
    "MiB",
    "RankFailure",
    "SyncPoints",
    "add_paths_argument",
    "add_run_arguments",
    "check_path",
    "cpu_seconds_of",
    "descendants",
    "finish",
    "format_table",
    "free_port",
    "loadavg",
    "median",
    "path_env",
    "run_configs",
    "run_ranks",
    "shm_report",
    "write_json",
]
