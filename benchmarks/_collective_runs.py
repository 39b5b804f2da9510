"""A timed collective against a fresh hub, as ``allreduce.py`` and ``gpu.py`` measure it.

* :func:`schedule`, :func:`default_timeout`, :data:`COLLECTIVE_TIMEOUT`: how many untimed and
  timed iterations a payload size gets, and how long a configuration may take.
* :func:`coordinator`, :func:`check_shards`: the hub of a gradstar configuration, and the check
  that the ranks' groups were striped over the shards it was started with.
* :func:`run_sampled`: ranks against a fresh hub on one data path, the hub's CPU sampled while
  every rank is held at a sync point right before and right after its timed loop.
* :func:`summarize`, :func:`hub_cpu`: what the ranks' reports and those samples add up to.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from _paths import check_path, path_env
from _processes import BenchmarkError, CoordinatorProcess
from _ranks import DriverSync, SyncPoints, run_ranks
from _report import fmt, median, per_gb

# size in MiB -> (warmup, timed iterations) when --warmup / --iters are not given
_SCHEDULE = [(1, 5, 50), (16, 3, 20), (64, 2, 10), (float("inf"), 1, 5)]
COLLECTIVE_TIMEOUT = 300.0  # gradstar's own per-collective timeout, as in the brief


def schedule(size_mb: float, warmup: int | None, iters: int | None) -> tuple[int, int]:
    for limit, w, i in _SCHEDULE:
        if size_mb <= limit:
            return (w if warmup is None else warmup), (i if iters is None else iters)
    raise AssertionError


def default_timeout(ranks: int, size_mb: float, warmup: int, iters: int) -> float:
    """Generous but bounded: start-up, plus 0.1 s per MiB per rank per collective (gradstar
    measured ~0.01 s/MiB at 2 ranks), kept between 120 s and 600 s. gradstar's own collective
    timeout (300 s) fires first when a rank goes missing, so its error message is reported."""
    estimate = 60 + (warmup + iters + 3) * size_mb * ranks * 0.1
    return max(120.0, min(600.0, estimate))


def coordinator(shards: int, env: dict[str, str]) -> CoordinatorProcess:
    """The hub for a gradstar configuration: ``gradstar coordinator --shards K`` (K shard
    processes each start and register before the coordinator prints its address), with
    ``env`` added to its environment."""
    return CoordinatorProcess(shards=shards, start_timeout=60.0 + 10.0 * shards, env=env)


def check_shards(results: list[dict], shards: int, label: str) -> None:
    """Fail if the ranks' groups are not striped over the ``shards`` the hub was started with
    (ranks that do not report it are not checked)."""
    seen = {r.get("shards") for r in results} - {None}
    if seen and seen != {shards}:
        raise BenchmarkError(f"[{label}] the coordinator was started with --shards {shards} but "
                             f"the ranks' groups are striped over {sorted(seen)} shards")


@dataclass
class SampledRun:
    """What :func:`run_sampled` saw: the ranks' results, the hub's CPU samples at sync points 0
    and 1 (``{point: (monotonic, CoordinatorProcess.cpu_sample())}``), the ranks' segments the
    hub had mapped at point 1 (None: unknown or meaningless), why sampling failed, and the
    coordinator's exit code."""

    results: list[dict]
    samples: dict[int, tuple[float, dict | None]]
    hub_shm_mappings: int | None
    sync_errors: list[str]
    exit_code: int | None = None


def run_sampled(target: Callable, ranks: int, args: Callable[[str, SyncPoints], tuple], *,
                shards: int, path: str, nbytes: int, timeout: float, label: str,
                extra_env: dict[str, str] | None = None) -> SampledRun:
    """Run ``target(rank, ranks, *args(address, sync))`` in ``ranks`` processes against a fresh
    :func:`coordinator` with ``shards``, hub and ranks set up for data path ``path`` (and
    ``extra_env`` added to both environments). Each rank
    calls ``sync.reach(0)`` and ``sync.reach(1)`` around its timed loop, where the hub's CPU is
    sampled; its result carries :func:`~_paths.shm_report` and ``shards``.

    Raises:
        BenchmarkError: the ranks failed, the coordinator exited, or the ranks did not use
            ``shards`` shards or the path ``path`` (with the coordinator's log tail).
    """
    from gradstar.transport.shm import POOL_KEEP_BYTES
    from gradstar.wire import MAX_BATCHED_CHUNK_BYTES

    env = path_env(path) | (extra_env or {})
    coord = coordinator(shards, env)
    run = None
    try:
        coord.start()
        samples: dict[int, tuple[float, dict | None]] = {}
        mappings: list[int | None] = []

        def sample(point: int) -> None:
            samples[point] = (time.monotonic(), coord.cpu_sample())
            if point == 1:  # every rank is alive and holds its segments
                mappings.append(coord.shm_mappings())

        with DriverSync(ranks, 2, sample, timeout=timeout) as sync:
            results = run_ranks(target, ranks, args(coord.address, sync.handle),
                                timeout=timeout, label=label, env=env)
        if not coord.alive():
            raise BenchmarkError(f"[{label}] the coordinator exited during the run (code "
                                 f"{coord.proc.returncode})")
        check_shards(results, shards, label)
        # A rank closes a segment above the pool's keep limit after each collective, and the
        # hub then drops its mapping: count or not, it proves nothing; the ranks' reports do.
        # A payload the blocking API's direct lane takes (gradstar.client.collective.direct)
        # rides the stream on either path: nothing is ever mapped for it.
        hub_mappings = (mappings[0] if mappings and MAX_BATCHED_CHUNK_BYTES < nbytes
                        <= POOL_KEEP_BYTES else None)
        check_path(results, path, label, hub_mappings)
        if sync.errors:
            print(f"  note: [{label}] hub CPU not sampled: {'; '.join(sync.errors)}",
                  file=sys.stderr)
        run = SampledRun(results, samples, hub_mappings, sync.errors)
    except BenchmarkError as error:
        tail = coord.log_tail() if coord.proc is not None else "(not started)"
        raise BenchmarkError(f"{error}\n--- coordinator log tail ---\n{tail}") from None
    finally:
        code = coord.stop()
        if run is not None:
            run.exit_code = code
        if code not in (0, None):
            print(f"  note: the coordinator for {label} ended with exit code {code}",
                  file=sys.stderr)
    return run


def summarize(results: list[dict], nbytes: int, iters: int) -> dict:
    """Rank 0's median time and the figures of a timed loop of ``iters`` collectives of
    ``nbytes`` per rank; each result holds ``times``, ``join_s``, ``cpu_s`` (and ``device``)."""
    times = results[0]["times"]
    med = median(times) if times else float("nan")
    gb_moved = nbytes * len(results) * iters / 1e9
    ranks_cpu = sum(r["cpu_s"] for r in results)
    summary = {
        "median_ms": med * 1e3,
        "min_ms": min(times) * 1e3 if times else None,
        "max_ms": max(times) * 1e3 if times else None,
        "rank0_times_ms": [round(t * 1e3, 3) for t in times],
        "median_ms_by_rank": [round(median(r["times"]) * 1e3, 3) if r["times"] else None
                              for r in results],
        "algbw_gbps": nbytes / med / 1e9 if times else None,  # = GB/s per rank
        "join_s_max": max(r["join_s"] for r in results),
        "gb_moved": gb_moved,
        "ranks_cpu_s": round(ranks_cpu, 4),
        "ranks_cpu_s_by_rank": [round(r["cpu_s"], 4) for r in results],
        "ranks_cpu_s_per_gb": per_gb(ranks_cpu, gb_moved),
        "error": None,
    }
    if "device" in results[0]:
        summary["devices"] = [r["device"] for r in results]
    return summary


def hub_cpu(samples: dict, gb_moved: float) -> dict:
    """Hub CPU fields from the samples taken at sync points 0 and 1 ((monotonic, cpu_sample))."""
    if 0 not in samples or 1 not in samples or None in (samples[0][1], samples[1][1]):
        return {"hub_cpu_s": None, "hub_cpu_s_per_gb": None, "hub_cores": None}
    (t0, a), (t1, b) = samples[0], samples[1]
    hub = b["total_s"] - a["total_s"]
    window = t1 - t0
    return {
        "hub_cpu_s": round(hub, 4),
        "hub_coordinator_cpu_s": round(b["coordinator_s"] - a["coordinator_s"], 4),
        "hub_shards_cpu_s": round(b["shards_s"] - a["shards_s"], 4),
        "hub_cpu_s_per_gb": per_gb(hub, gb_moved),
        "hub_window_s": round(window, 4),
        "hub_cores": hub / window if window > 0 else None,
        "shard_processes": len(b["shard_pids"]),
        # a shard restarted or vanished during the timed loop: its work was partly lost
        "shard_pids_changed": a["shard_pids"] != b["shard_pids"],
    }


def detail_row(ranks: int, size_mb: float, name: str, result: dict, gradstar: bool) -> list:
    """One line of an all_reduce detail table: time, ratio, GB/s/rank, CPU s/GB (hub, ranks,
    total) and hub cores; a gradstar configuration whose hub CPU is unknown has no total."""
    if result["error"]:
        return [ranks, f"{size_mb:g}", name, "FAILED"] + ["-"] * 6
    hub, ranks_cpu = result.get("hub_cpu_s_per_gb"), result.get("ranks_cpu_s_per_gb")
    total = ranks_cpu if not gradstar else (
        None if hub is None or ranks_cpu is None else hub + ranks_cpu)
    return [ranks, f"{size_mb:g}", name, f"{result['median_ms']:.2f}",
            fmt(result.get("ratio"), ".2f"), fmt(result["algbw_gbps"], ".3f"),
            fmt(hub, ".3f") if gradstar else "-", fmt(ranks_cpu, ".3f"), fmt(total, ".3f"),
            fmt(result.get("hub_cores"), ".2f") if gradstar else "-"]


DETAIL_HEADERS = ["ranks", "size MB", "backend", "ms", "ratio", "GB/s/rank", "hub CPU s/GB",
                  "ranks CPU s/GB", "total CPU s/GB", "hub cores"]


__all__ = ["COLLECTIVE_TIMEOUT", "DETAIL_HEADERS", "SampledRun", "check_shards", "coordinator",
           "default_timeout", "detail_row", "hub_cpu", "run_sampled", "schedule", "summarize"]
