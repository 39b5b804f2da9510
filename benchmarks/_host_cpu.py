"""CPU per emulated host for ``benchmarks/sync_modes.py``: a cgroup each (cgroup v1's cpu
controller or v2's ``cpu.max``), so a host's ranks share a fixed part of a core and one host can
be made slow by construction (see that module's docstring)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from _harness import BenchmarkError

#: Waits for a line on stdin (the driver moves it into a cgroup first), then times itself.
CALIBRATION_LOOP = ("import sys, time\nsys.stdin.readline()\nt = time.perf_counter()\ns = 0\n"
                    "for i in range(2_000_000):\n    s += i\nprint(time.perf_counter() - t)")


class HostCpu:
    """One cgroup per rank host, each limited to ``cores`` of one core (see the module):
    :meth:`limit` a host, :meth:`add` a process to one, :meth:`remove` them all."""

    PERIOD_US = 30_000  # short: a rank is throttled evenly; quota >= 1000 us, the kernel's least

    def __init__(self, hosts: list[str], cores: float) -> None:
        root = Path("/sys/fs/cgroup")
        self.v2 = (root / "cgroup.controllers").exists()  # unified hierarchy
        if not self.v2 and not (root / "cpu" / "cpu.cfs_quota_us").exists():
            raise BenchmarkError("no cgroup cpu controller at /sys/fs/cgroup (v2) or "
                                 "/sys/fs/cgroup/cpu (v1): cannot limit the hosts' CPU")
        if self.v2 and "cpu" not in (root / "cgroup.subtree_control").read_text().split():
            (root / "cgroup.subtree_control").write_text("+cpu")
        parent = root if self.v2 else root / "cpu"
        self.paths: dict[str, Path] = {}
        for host in hosts:
            path = parent / f"gradstar-bench-{os.getpid()}-{host}"
            path.mkdir()
            self.paths[host] = path
            self.limit(host, cores)

    def limit(self, host: str, cores: float) -> str:
        """Give ``host``'s processes ``cores`` of one core; returns what was written where."""
        quota, path = round(self.PERIOD_US * cores), self.paths[host]
        if quota < 1000:
            raise BenchmarkError(f"{cores} of a core is a quota of {quota} us per "
                                 f"{self.PERIOD_US} us; the kernel's least is 1000")
        if self.v2:
            (path / "cpu.max").write_text(f"{quota} {self.PERIOD_US}")
            return f"{path}/cpu.max = {quota} {self.PERIOD_US}"
        (path / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
        (path / "cpu.cfs_quota_us").write_text(str(quota))
        return f"{path}: cpu.cfs_period_us {self.PERIOD_US}, cpu.cfs_quota_us {quota}"

    def add(self, host: str, pid: int) -> None:
        """Move process ``pid`` (all its threads; what it starts later is born inside)."""
        (self.paths[host] / "cgroup.procs").write_text(str(pid))

    def time_loop(self, host: str | None) -> float:
        """Seconds a fixed pure-Python loop takes in ``host``'s cgroup (None: outside)."""
        proc = subprocess.Popen([sys.executable, "-c", CALIBRATION_LOOP], text=True,
                                stdout=subprocess.PIPE, stdin=subprocess.PIPE)
        if host is not None:
            self.add(host, proc.pid)
        out, _ = proc.communicate("go\n", timeout=120)
        return float(out)

    def remove(self) -> None:
        """Delete the cgroups once their processes are gone (waits up to 10 s each)."""
        for path in self.paths.values():
            for _ in range(100):
                try:
                    if path.exists():
                        path.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
            else:
                print(f"could not remove {path}: processes left in it", file=sys.stderr)
