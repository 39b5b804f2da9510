"""The main-job command runs end to end and reports exact results."""

from __future__ import annotations

import asyncio
import sys


async def test_demo_runs_to_its_report():
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gradstar", "demo", "--workers", "2", "--mb", "1", "--rounds", "2",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    text = out.decode()
    assert proc.returncode == 0, text + err.decode()[-2000:]
    assert "demo passed: every collective result was exact" in text
    assert text.count("exact") >= 3  # one line per rank plus the verdict
