"""Regenerate docs/status-page.png: the status page of a coordinator while the demo's training
job runs on it (4 ranks, ddp, one of them niced: the straggler), beside a job that completed
and one that lost a rank. Needs Chromium (scripts/ensure_chromium.sh) and the dev set-up.

    .venv/bin/python scripts/status_page_screenshot.py [--out docs/status-page.png]
    .venv/bin/python scripts/status_page_screenshot.py --shards 2 --size 1280,760 \
        --out docs/status-page-stragglers.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: A job of two ranks: each all_reduces; then rank 1 of job "sweep-lr0.3" dies, the others close.
SHORT_JOB = """
import os, numpy as np, gradstar
pg = gradstar.init_process_group(timeout=60, join_timeout=60)
for _ in range(20):
    pg.all_reduce(np.ones(100_000, np.float32))
if os.environ["GRADSTAR_JOB"] == "sweep-lr0.3" and pg.rank == 1:
    os._exit(1)
pg.barrier()
pg.close()
"""


def env(**settings: str) -> dict[str, str]:
    """This environment without GRADSTAR_* variables, plus ``settings`` as GRADSTAR_*."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("GRADSTAR_")}
    return {**base, "GRPC_VERBOSITY": "ERROR", "PYTHONUNBUFFERED": "1",
            **{f"GRADSTAR_{k.upper()}": v for k, v in settings.items()}}


def rank(address: str, job: str, world: int, rank: int) -> dict[str, str]:
    return env(coordinator=address, job=job, world_size=str(world), rank=str(rank))


def wait_line(proc: subprocess.Popen, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if match := re.search(pattern, line):
            return match
        if not line and proc.poll() is not None:
            break
    raise SystemExit(f"status_page_screenshot: no line matching {pattern!r}")


def wait_running(page: str, job: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(page + "/status.json", timeout=10) as reply:
            jobs = {j["name"]: j for j in json.load(reply)["jobs"]}
        if jobs.get(job, {}).get("state") == "running":
            return
        time.sleep(0.5)
    raise SystemExit(f"status_page_screenshot: job {job!r} did not start in {timeout:g} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "status-page.png")
    parser.add_argument("--size", default="1280,1060", help="window WIDTH,HEIGHT")
    parser.add_argument("--shards", default="0",
                        help="the coordinator's --shards (2 for docs/status-page-stragglers.png: "
                             "the slowest-ranks table measured by hub shards)")
    args = parser.parse_args()
    signal.alarm(600)  # a bound on everything below, blocking reads included
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("status_page_screenshot: needs Chromium (scripts/ensure_chromium.sh)")
    procs: list[subprocess.Popen] = []
    try:
        hub = subprocess.Popen(
            [sys.executable, "-m", "gradstar", "coordinator", "--host", "127.0.0.1", "--port",
             "0", "--metrics-port", "0", "--shards", args.shards, "--log-level", "ERROR"],
            stdout=subprocess.PIPE, text=True, env=env())
        procs.append(hub)
        said = r"^gradstar coordinator (listening on |metrics on http://)[\d.]+:(\d+)"
        address = "127.0.0.1:" + wait_line(hub, said, 60)[2]
        page = "http://127.0.0.1:" + wait_line(hub, said, 60)[2]
        for job in ("warmup", "sweep-lr0.3"):
            short = [subprocess.Popen([sys.executable, "-c", SHORT_JOB],
                                      env=rank(address, job, 2, r), stdout=subprocess.DEVNULL)
                     for r in range(2)]
            for p in short:
                p.wait(timeout=120)
        train = [sys.executable, "-m", "gradstar.worker.demo.train", "--mode", "ddp", "--epochs",
                 "50", "--progress", "none"]
        # Rank 3 runs at the lowest CPU priority, as on a busy host: the straggler.
        procs += [subprocess.Popen(train, env=rank(address, "demo-ddp", 4, r),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   preexec_fn=(lambda: os.nice(19)) if r == 3 else None)
                  for r in range(4)]
        wait_running(page, "demo-ddp", 120)
        time.sleep(12)  # a few epochs: lags, counters and a full rate window
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run(
                [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                 f"--user-data-dir={profile}", f"--window-size={args.size}",
                 "--virtual-time-budget=3000", f"--screenshot={args.out}", page + "/"],
                check=True, timeout=120, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"status_page_screenshot: wrote {args.out}")
        return 0
    finally:
        for p in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    raise SystemExit(main())
