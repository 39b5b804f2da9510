"""Hub memory of a broadcast to a late rank: how much the coordinator grows while it forwards.

What is measured
    A ``gradstar coordinator`` subprocess on 127.0.0.1 (``--shards 0``: the single in-process
    hub) and ``--ranks`` spawned rank processes (default 4) in one job. Every rank joins, then
    waits at a sync point while this script reads the hub's VmRSS (/proc/PID/status) as the
    baseline and starts sampling it every ``--sample-ms`` ms (default 50) on a thread. Rank 0
    then broadcasts a float32 array of ``--mb`` MiB (default 512); ranks 1.. receive it, the last
    one starting its broadcast ``--late`` seconds (default 5) after the others, so the root has
    streamed as far as the hub lets it before the collective is even matched. Every receiver
    checks its result exactly against the root's data. The script prints the baseline, the peak
    growth over it, and the time the broadcast took on the late rank.

    Before the hub bounded forwarding (commit fc781b2), it read the root's whole tensor and held
    it for the late rank: growth was the tensor size and more. With the read window
    (``coordinator/engine.py``: at most READ_AHEAD_CHUNKS chunks held per sender before matching,
    and per receiver queued but not delivered afterwards) it is a few windows of 2 MiB chunks plus
    what gRPC buffers per stream, whatever the tensor size.

How to reproduce
    .venv/bin/python benchmarks/broadcast_memory.py                      # 512 MiB, 4 ranks, 5 s
    .venv/bin/python benchmarks/broadcast_memory.py --mb 1024 --late 3 --json /tmp/bcast.json

Every wait is bounded (``--timeout``); the exit code is 1 if the run failed or a result differed.
"""

from __future__ import annotations

import argparse
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
    add_run_arguments,
    run_ranks,
    write_json,
)


def vm_rss(pid: int) -> int:
    """Resident bytes of process ``pid`` (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise BenchmarkError(f"/proc/{pid}/status has no VmRSS")


class RssSampler:
    """Samples a process's VmRSS every ``every`` seconds on a thread, from :meth:`start`."""

    def __init__(self, pid: int, every: float) -> None:
        self.pid = pid
        self.every = every
        self.baseline = 0
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")

    def start(self) -> None:
        self.baseline = self.peak = vm_rss(self.pid)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.peak = max(self.peak, vm_rss(self.pid))
            except OSError:  # the hub exited; the run reports why
                return
            self.samples += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


def rank_main(rank: int, world_size: int, address: str, job: str, mb: int, late: float,
              timeout: float, sync) -> dict:
    """One rank: join, wait at the sync point, broadcast (the last rank ``late`` s late)."""
    import numpy as np

    import gradstar

    pg = gradstar.init_process_group(coordinator=address, job=job, world_size=world_size,
                                     rank=rank, timeout=timeout, join_timeout=60)
    try:
        n = mb * MiB // 4
        data = np.arange(n, dtype=np.float32)
        x = data if rank == 0 else np.empty(n, dtype=np.float32)
        sync.reach(0)
        if rank == world_size - 1:
            time.sleep(late)
        t0 = time.perf_counter()
        result = pg.broadcast(x, 0)
        seconds = time.perf_counter() - t0
        return {"exact": bool(np.array_equal(result, data)), "seconds": seconds}
    finally:
        pg.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--mb", type=int, default=512, help="MiB of float32 broadcast")
    parser.add_argument("--ranks", type=int, default=4, help="world size (rank 0 is the root)")
    parser.add_argument("--late", type=float, default=5.0,
                        help="seconds the last rank starts its broadcast after the others")
    parser.add_argument("--sample-ms", type=float, default=50.0, help="VmRSS sampling period")
    add_run_arguments(parser, timeout=300.0)
    args = parser.parse_args()
    if args.ranks < 2:
        parser.error("--ranks must be at least 2")
    with CoordinatorProcess(shards=0) as coord:
        sampler = RssSampler(coord.proc.pid, args.sample_ms / 1e3)
        with DriverSync(args.ranks, 1, lambda point: sampler.start(),
                        timeout=args.timeout) as sync:
            try:
                results = run_ranks(rank_main, args.ranks,
                                    (coord.address, f"bcast-mem-{time.time_ns()}", args.mb,
                                     args.late, args.timeout, sync.handle),
                                    timeout=args.timeout, label=f"{args.mb} MiB broadcast")
            finally:
                sampler.stop()
        if sync.errors:
            raise BenchmarkError("; ".join(sync.errors))
    growth = sampler.peak - sampler.baseline
    exact = all(r["exact"] for r in results)
    print(f"broadcast of {args.mb} MiB from rank 0 to {args.ranks - 1} ranks, rank "
          f"{args.ranks - 1} {args.late:g} s late: hub VmRSS {sampler.baseline / MiB:.0f} MiB "
          f"before, peak growth {growth / MiB:.1f} MiB ({sampler.samples} samples every "
          f"{args.sample_ms:g} ms); late rank's broadcast took {results[-1]['seconds']:.2f} s; "
          f"results {'exact' if exact else 'DIFFER'}")
    if args.json is not None:
        write_json(args, "broadcast_memory", baseline_bytes=sampler.baseline,
                   peak_growth_bytes=growth, samples=sampler.samples, exact=exact,
                   ranks=results)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
