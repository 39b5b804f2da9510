"""Hub memory of a broadcast to a late rank: how much the coordinator grows while it forwards.

What is measured
    A ``gradstar coordinator`` subprocess on 127.0.0.1 (``--shards 0``: the single in-process
    hub) and ``--ranks`` spawned rank processes (default 4) in one job, once per data path
    (``--paths``, default both) and ``--runs`` times each (a fresh hub and fresh ranks every
    time):

    * ``stream``: every payload byte on the gRPC stream, as for ranks on other hosts
      (GRADSTAR_SHARED_MEMORY=0 for the coordinator and the ranks);
    * ``shm``: the same-host fast path (GRADSTAR_SHARED_MEMORY=1): each rank passes its chunks
      through a memfd segment the hub maps, and only small frames travel on the stream.

    Every rank joins, then waits at a sync point while this script reads the hub's
    /proc/PID/status as the baseline and starts sampling it every ``--sample-ms`` ms (default 50)
    on a thread. Rank 0 then broadcasts a float32 array of ``--mb`` MiB (default 512); ranks 1..
    receive it, the last one starting its broadcast ``--late`` seconds (default 5) after the
    others, so the root has sent as far as the hub lets it before the collective is even matched.
    With ``--iters N`` the ranks do N such broadcasts, each after a barrier. Every receiver checks
    every result exactly against the root's data, and every rank reports the data path its group
    took (a run whose ranks did not take the path it is labelled with fails).

    The hub's memory is its *private* resident memory, VmRSS minus RssShmem: on the shm path the
    hub maps the ranks' segments, and the pages of them it touches count in its VmRSS although
    they are the ranks' memory (the ranks allocated them and pay for them whether or not a hub
    maps them). "growth" is the peak of VmRSS - RssShmem over its baseline; the table also shows
    the peak growth of VmRSS itself and the peak RssShmem, and the time of the late rank's
    broadcast (the median over ``--iters``; with ``--late 0`` this is plain broadcast latency).

    Before the hub bounded forwarding (commit fc781b2), it read the root's whole tensor and held
    it for the late rank: growth was the tensor size and more. With the read window
    (``coordinator/collective/window.py``: at most FORWARD_AHEAD_CHUNKS chunks held before
    matching, and as many queued but not delivered per receiver afterwards) it is a few windows
    of 2 MiB chunks plus what gRPC buffers per stream, whatever the tensor size; on the shm path
    the hub copies chunks from the root's segment straight into the receivers' and holds none
    itself.

How to reproduce
    .venv/bin/python benchmarks/broadcast_memory.py                  # 512 MiB, 4 ranks, 5 s, both
    .venv/bin/python benchmarks/broadcast_memory.py --paths stream shm --runs 3
    .venv/bin/python benchmarks/broadcast_memory.py --mb 1024 --late 3 --json /tmp/bcast.json
    # broadcast latency, no late rank
    .venv/bin/python benchmarks/broadcast_memory.py --mb 64 --late 0 --ranks 2 --iters 10

Every wait is bounded (``--timeout`` per run); the exit code is 1 if a run failed, a result
differed or a run did not take its data path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    BenchmarkError,
    CoordinatorProcess,
    DriverSync,
    MiB,
    add_paths_argument,
    add_run_arguments,
    check_path,
    format_table,
    path_env,
    run_ranks,
    shm_report,
    write_json,
)


def hub_memory(pid: int) -> tuple[int, int]:
    """(VmRSS, RssShmem) of process ``pid`` in bytes (Linux /proc; RssShmem 0 if absent)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "RssShmem:")):
            fields[line.split(":")[0]] = int(line.split()[1]) * 1024
    if "VmRSS" not in fields:
        raise BenchmarkError(f"/proc/{pid}/status has no VmRSS")
    return fields["VmRSS"], fields.get("RssShmem", 0)


class RssSampler:
    """Samples a process's VmRSS and RssShmem every ``every`` seconds on a thread, from
    :meth:`start`; keeps the baseline and the peaks of VmRSS, RssShmem and their difference."""

    def __init__(self, pid: int, every: float) -> None:
        self.pid = pid
        self.every = every
        self.baseline_rss = self.baseline_private = 0
        self.peak_rss = self.peak_private = self.peak_shmem = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")

    def start(self) -> None:
        rss, shmem = hub_memory(self.pid)
        self.baseline_rss = self.peak_rss = rss
        self.baseline_private = self.peak_private = rss - shmem
        self.peak_shmem = shmem
        self._thread.start()

    def _sample(self) -> None:
        rss, shmem = hub_memory(self.pid)
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_private = max(self.peak_private, rss - shmem)
        self.peak_shmem = max(self.peak_shmem, shmem)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self._sample()
            except OSError:  # the hub exited; the run reports why
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    @property
    def growth(self) -> int:
        """Peak private memory (VmRSS - RssShmem) over its baseline."""
        return self.peak_private - self.baseline_private


def rank_main(rank: int, world_size: int, address: str, job: str, mb: int, late: float,
              iters: int, timeout: float, sync) -> dict:
    """One rank: join, wait at the sync point, broadcast ``iters`` times (the last rank ``late``
    s late each time), report its data path."""
    import numpy as np

    import gradstar

    pg = gradstar.init_process_group(coordinator=address, job=job, world_size=world_size,
                                     rank=rank, timeout=timeout, join_timeout=60)
    try:
        n = mb * MiB // 4
        data = np.arange(n, dtype=np.float32)
        x = data if rank == 0 else np.empty(n, dtype=np.float32)
        sync.reach(0)
        exact, times = True, []
        for _ in range(iters):
            pg.barrier()
            if rank == world_size - 1:
                time.sleep(late)
            t0 = time.perf_counter()
            result = pg.broadcast(x, 0)
            times.append(time.perf_counter() - t0)
            exact = exact and bool(np.array_equal(result, data))
            del result
        report = shm_report(pg)
        pg.barrier()  # nobody leaves while a peer is still in its last collective
        return {"exact": exact, "times": times, **report}
    finally:
        pg.close()


def run_once(args: argparse.Namespace, path: str, run: int) -> dict:
    """One hub and ``args.ranks`` ranks on ``path``: the hub's memory and the late rank's time."""
    env = path_env(path)
    label = f"{path} run {run + 1}"
    with CoordinatorProcess(shards=0, env=env) as coord:
        sampler = RssSampler(coord.proc.pid, args.sample_ms / 1e3)
        with DriverSync(args.ranks, 1, lambda point: sampler.start(),
                        timeout=args.timeout) as sync:
            try:
                results = run_ranks(rank_main, args.ranks,
                                    (coord.address, f"bcast-mem-{time.time_ns()}", args.mb,
                                     args.late, args.iters, args.timeout, sync.handle),
                                    timeout=args.timeout, label=label, env=env)
            finally:
                sampler.stop()
        if sync.errors:
            raise BenchmarkError(f"[{label}] " + "; ".join(sync.errors))
        if not coord.alive():
            raise BenchmarkError(f"[{label}] the coordinator exited during the run; log tail:\n"
                                 f"{coord.log_tail()}")
    check_path(results, path, label)
    return {"path": path, "run": run + 1, "baseline_rss_bytes": sampler.baseline_rss,
            "baseline_private_bytes": sampler.baseline_private,
            "growth_bytes": sampler.growth,
            "rss_growth_bytes": sampler.peak_rss - sampler.baseline_rss,
            "peak_shmem_bytes": sampler.peak_shmem, "samples": sampler.samples,
            "late_rank_seconds": statistics.median(results[-1]["times"]),
            "late_rank_times": results[-1]["times"],
            "exact": all(r["exact"] for r in results)}


def _table(runs: list[dict]) -> str:
    rows = [(r["path"], r["run"], f"{r['baseline_private_bytes'] / MiB:.0f}",
             f"{r['growth_bytes'] / MiB:+.1f}", f"{r['rss_growth_bytes'] / MiB:+.1f}",
             f"{r['peak_shmem_bytes'] / MiB:.0f}", f"{r['late_rank_seconds']:.3f}",
             "exact" if r["exact"] else "DIFFER") for r in runs]
    return format_table(("path", "run", "private MiB before", "growth MiB", "VmRSS growth MiB",
                         "RssShmem peak MiB", "late rank s", "results"), rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--mb", type=int, default=512, help="MiB of float32 broadcast")
    parser.add_argument("--ranks", type=int, default=4, help="world size (rank 0 is the root)")
    parser.add_argument("--late", type=float, default=5.0,
                        help="seconds the last rank starts its broadcast after the others")
    parser.add_argument("--iters", type=int, default=1, help="broadcasts per run")
    parser.add_argument("--runs", type=int, default=1,
                        help="runs per data path, each with a fresh hub and fresh ranks")
    parser.add_argument("--sample-ms", type=float, default=50.0, help="sampling period")
    add_paths_argument(parser)
    add_run_arguments(parser, timeout=300.0)
    args = parser.parse_args()
    if args.ranks < 2:
        parser.error("--ranks must be at least 2")
    if args.iters < 1 or args.runs < 1:
        parser.error("--iters and --runs must be at least 1")
    runs, failures = [], []
    for run in range(args.runs):
        for path in args.paths:
            try:
                runs.append(run_once(args, path, run))
            except BenchmarkError as error:
                failures.append(f"{path} run {run + 1}: {error}")
                print(f"  {path} run {run + 1}: FAILED", file=sys.stderr, flush=True)
    print(f"broadcast of {args.mb} MiB from rank 0 to {args.ranks - 1} ranks, rank "
          f"{args.ranks - 1} {args.late:g} s late, {args.iters} per run; hub growth = peak of "
          f"VmRSS - RssShmem (its private memory) over its baseline, sampled every "
          f"{args.sample_ms:g} ms")
    print(_table(sorted(runs, key=lambda r: (r["path"], r["run"]))))
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    if args.json is not None:
        write_json(args, "broadcast_memory", runs=runs, failures=failures)
    return 0 if runs and not failures and all(r["exact"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
