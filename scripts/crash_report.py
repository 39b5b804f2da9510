"""Run a command; if it dies of a signal that dumps core, print the native stacks of its threads.

    python scripts/crash_report.py -- COMMAND [ARG ...]

``make test`` runs pytest through this. A segfault of pytest's own process (the coordinators of
the integration tests run in it, with gRPC's threads) prints only Python's faulthandler lines,
which stop at the interpreter's frames and may be cut short; the native stack says where in
gRPC, numpy or CPython it happened. So core dumps are allowed for the command (its soft limit
raised to its hard one), and when it is killed by such a signal and a ``core`` file appeared in
the working directory, ``gdb`` (where installed) prints every thread's stack from it, and the
core file is removed. The exit status is the command's (128 + signal when it was killed). Where
the kernel sends cores elsewhere (``/proc/sys/kernel/core_pattern`` a pipe or a path) or gdb is
missing, it says so and exits the same way.
"""

from __future__ import annotations

import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

#: Signals whose default action dumps core.
CORE_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE,
                signal.SIGQUIT, signal.SIGSYS, signal.SIGTRAP}


def allow_core_dumps() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))


def find_core(pid: int, since: float) -> Path | None:
    """The core file of process ``pid`` written in this directory after ``since``, if any."""
    for name in (f"core.{pid}", "core"):
        path = Path(name)
        if path.is_file() and path.stat().st_mtime >= since:
            return path
    return None


def native_stacks(program: str, core: Path) -> str:
    gdb = shutil.which("gdb")
    if gdb is None:
        return "gdb is not installed: no native stacks"
    result = subprocess.run(
        # CPython's gdb helpers (py-bt), where its build installed them beside the binary.
        [gdb, "-batch", "-nx", "-iex", "set auto-load safe-path /", "-ex", "set pagination off",
         "-ex", "info threads", "-ex", "thread apply all bt 40", "-ex", "thread apply all py-bt",
         program, str(core)],
        capture_output=True, text=True, timeout=300, check=False)
    return result.stdout + result.stderr[-2000:]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    started = time.time()
    proc = subprocess.Popen(argv, preexec_fn=allow_core_dumps)
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        code = proc.wait()
    if code >= 0:
        return code
    sig = signal.Signals(-code)
    print(f"\ncrash_report: {' '.join(argv)} was killed by {sig.name}", flush=True)
    if sig in CORE_SIGNALS:
        core = find_core(proc.pid, started)
        if core is None:
            pattern = Path("/proc/sys/kernel/core_pattern")
            where = pattern.read_text().strip() if pattern.exists() else "unknown"
            print(f"crash_report: no core file here (core_pattern: {where!r})", flush=True)
        else:
            program = shutil.which(argv[0]) or argv[0]
            print(f"crash_report: native stacks from {core}:\n{native_stacks(program, core)}",
                  flush=True)
            core.unlink()
    return 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
