"""scripts/crash_report.py, through which ``make test`` runs pytest: a command's exit status
passes through, and a command killed by SIGSEGV is named, with its threads' native stacks where
this machine writes core files to the working directory and has gdb."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "scripts" / "crash_report.py"
CORE_PATTERN = Path("/proc/sys/kernel/core_pattern")


def run(tmp_path: Path, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--", *command], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)


def test_an_exit_status_passes_through(tmp_path):
    done = run(tmp_path, sys.executable, "-c", "raise SystemExit(3)")
    assert done.returncode == 3
    assert "crash_report" not in done.stdout


def test_a_segfault_is_named_with_the_native_stacks_and_its_status(tmp_path):
    done = run(tmp_path, sys.executable, "-c", "import ctypes; ctypes.string_at(0)")
    assert done.returncode == 128 + 11
    assert "was killed by SIGSEGV" in done.stdout, done.stdout
    cores_here = CORE_PATTERN.exists() and CORE_PATTERN.read_text().strip() in ("core",
                                                                                "core.%p")
    if cores_here and shutil.which("gdb"):
        assert "native stacks from core" in done.stdout, done.stdout
        assert "string_at" in done.stdout or "#0" in done.stdout, done.stdout
    assert not list(tmp_path.glob("core*")), "the core file was left behind"
