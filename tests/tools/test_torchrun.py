"""``torchrun`` runs an ordinary torch.distributed script with ``backend="gradstar"`` and nothing
else set: rank 0 starts the hub, the others find it through torch's store, and the trained
parameters equal the same script's over gloo. An elastic restart gets a fresh hub and job.

Real ``torchrun`` processes (the one in this venv), bounded by their own timeouts.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from gradstar import errors
from gradstar.client.torch_backend import backend, store_hub

SCRIPT = Path(__file__).with_name("torchrun_script.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")
pytestmark = pytest.mark.timeout(300)


def torchrun(out: Path, backend_name: str, nproc: int, *flags: str,
             die_once: int | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GRADSTAR_", "MASTER_", "TORCHELASTIC_"))}
    script_args = [] if die_once is None else ["--die-once", str(die_once)]
    return subprocess.run(
        [str(TORCHRUN), "--standalone", f"--nproc-per-node={nproc}", *flags, str(SCRIPT),
         backend_name, str(out), *script_args],
        env=env, capture_output=True, text=True, timeout=180)


def reports(out: Path, backend_name: str, nproc: int) -> list[dict]:
    return [json.loads((out / f"{backend_name}-rank{r}.json").read_text()) for r in range(nproc)]


def refused(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:
        return True
    return False


@pytest.mark.parametrize("nproc", [2, 3])
def test_torchrun_with_nothing_set_trains_like_gloo(tmp_path, nproc):
    for name in ("gradstar", "gloo"):
        run = torchrun(tmp_path, name, nproc)
        assert run.returncode == 0, run.stderr[-3000:]
    ours, theirs = reports(tmp_path, "gradstar", nproc), reports(tmp_path, "gloo", nproc)
    for mine, gloo in zip(ours, theirs, strict=True):
        for a, b in zip(mine["params"], gloo["params"], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert len({r["job"] for r in ours}) == 1 and ours[0]["job"].startswith("torch-")
    assert ours[0]["coordinator"].startswith("127.0.0.1:")  # every rank on this host
    assert refused(ours[0]["coordinator"])  # the hub went with rank 0's group
    # A hub that dies with rank 0 never comes back: no rank rides through its restart.
    assert all(r["reconnect_timeout"] == 0 for r in ours)


def test_an_elastic_restart_gets_a_fresh_hub_and_job(tmp_path):
    run = torchrun(tmp_path, "gradstar", 2, "--max-restarts=1", die_once=1)
    assert run.returncode == 0, run.stderr[-3000:]
    first = (tmp_path / "job-round0-rank0.txt").read_text()
    second = (tmp_path / "job-round1-rank0.txt").read_text()
    assert first != second
    assert (tmp_path / "job-round1-rank1.txt").read_text() == second
    assert [r["restart"] for r in reports(tmp_path, "gradstar", 2)] == [1, 1]


def test_a_rank_without_rank_0s_entry_says_what_to_set():
    store = dist.HashStore()
    with pytest.raises(errors.ConfigurationError, match=r"found no gradstar coordinator in "
                       r"torch's store within 0\.2 s.*GRADSTAR_COORDINATOR"):
        store_hub.find_or_make(store, 1, 2, timedelta(seconds=0.2))


def test_an_explicit_coordinator_wins_over_the_store(monkeypatch):
    store = dist.HashStore()
    monkeypatch.delenv("GRADSTAR_COORDINATOR", raising=False)
    assert backend._needs_store_hub(store, {})
    assert not backend._needs_store_hub(store, {"coordinator": "hub:29400"})
    monkeypatch.setenv("GRADSTAR_COORDINATOR", "hub:29400")
    assert not backend._needs_store_hub(store, {})


LIGHTNING_SCRIPT = Path(__file__).with_name("lightning_script.py")


def test_a_lightning_trainer_fits_like_gloo(tmp_path):
    """Lightning's DDPStrategy(process_group_backend="gradstar") on 2 CPU processes, which
    Lightning itself starts; nothing gradstar-specific set."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GRADSTAR_", "MASTER_", "TORCHELASTIC_", "LOCAL_", "RANK",
                                "WORLD_SIZE", "NODE_RANK"))}
    results = {}
    for name in ("gradstar", "gloo"):
        out = tmp_path / f"{name}.json"
        run = subprocess.run([sys.executable, str(LIGHTNING_SCRIPT), name, str(out)], env=env,
                             cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert run.returncode == 0, run.stderr[-3000:]
        results[name] = json.loads(out.read_text())
    assert results["gradstar"]["steps"] == results["gloo"]["steps"] == 8
    for a, b in zip(results["gradstar"]["params"], results["gloo"]["params"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_torchrun_with_the_c10d_rendezvous_backend(tmp_path):
    run = subprocess.run(
        [str(TORCHRUN), "--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=c10d",
         f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(SCRIPT), "gradstar", str(tmp_path)],
        env=clean_env(), capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len({r["job"] for r in reports(tmp_path, "gradstar", 2)}) == 1


def test_two_torchrun_nodes_share_rank_0s_hub(tmp_path):
    """Two torchrun agents (--nnodes 2, one process each) on this host stand in for two hosts:
    rank 0's hub then listens on every interface and is advertised by name (here 127.0.0.1,
    through GRADSTAR_ADVERTISE_HOST, so the test reaches nothing but loopback)."""
    port = free_port()
    env = dict(clean_env(), GRADSTAR_ADVERTISE_HOST="127.0.0.1")
    nodes = [subprocess.Popen(
        [str(TORCHRUN), "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1",
         "--master-addr=127.0.0.1", f"--master-port={port}", str(SCRIPT), "gradstar",
         str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)]
    try:
        outcomes = [node.communicate(timeout=180) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [n.returncode for n in nodes] == [0, 0], [err[-2000:] for _, err in outcomes]
    ours = reports(tmp_path, "gradstar", 2)
    assert ours[0]["coordinator"] == ours[1]["coordinator"]
    assert ours[0]["coordinator"].startswith("127.0.0.1:")
    for a, b in zip(ours[0]["params"], ours[1]["params"], strict=True):
        assert a == b


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("GRADSTAR_", "MASTER_", "TORCHELASTIC_"))}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
