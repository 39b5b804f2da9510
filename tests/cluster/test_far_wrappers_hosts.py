"""Every wrapper across far hosts: DDP, FSDP, a Pipeline with a stage on each host and
Streaming DiLoCo (:mod:`tests.cluster.wrappers_rank`) on 3 hosts, once with the hosts next to
each other and once with every two of them 100 ms apart (delay lines, ``rtt=100``). A far link
changes no result: every wrapper ends with the same parameters both times (float32 sums met in
another order: close, not bitwise), DDP's replicas are bitwise equal, and the Pipeline's stages
equal one process training the whole model on the whole batch.

Needs root and iproute2 (CI runs as root); elsewhere it fails saying why.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from torch import nn

from tests.cluster.jobs import hosts_network, job_on_hosts, wait_reports
from tests.cluster.wrappers_rank import HIDDEN, IN, OUT, STEPS, batch

HOSTS = ["host0", "host1", "host2"]
WRAPPERS = ("ddp", "fsdp", "pipeline", "streaming_diloco")
pytestmark = pytest.mark.timeout(480)


def one_process_pipeline() -> list[np.ndarray]:
    """wrappers_rank's pipeline stages (seed 1 + stage) as one model, trained by one process
    on the whole batch: each stage's final parameters, flat."""
    width = [IN, HIDDEN, HIDDEN, OUT]
    stages = []
    for stage in range(len(HOSTS)):
        torch.manual_seed(1 + stage)
        stages.append(nn.Sequential(nn.Linear(width[stage], width[stage + 1]), nn.Tanh()))
    model = nn.Sequential(*stages)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = batch(0, step, rows=16)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [torch.cat([p.detach().reshape(-1) for p in s.parameters()]).numpy()
            for s in stages]


def test_every_wrapper_trains_across_far_hosts_as_across_near_ones(tmp_path):
    argv = [sys.executable, "-m", "tests.cluster.wrappers_rank"]
    runs = {}
    for name, rtt in (("near", None), ("far", 100)):
        out = tmp_path / name
        out.mkdir()
        with hosts_network(HOSTS, rtt=rtt) as network:
            with job_on_hosts(network, out, 1, [*argv, str(out)]) as (procs, _):
                runs[name] = {r["rank"]: r for r in wait_reports(out, "wrappers", 3, procs, 360)}
    reference = one_process_pipeline()
    for rank in range(len(HOSTS)):
        for wrapper in WRAPPERS:
            np.testing.assert_allclose(runs["far"][rank][wrapper], runs["near"][rank][wrapper],
                                       rtol=1e-5, atol=1e-6,
                                       err_msg=f"{wrapper} on rank {rank}, 100 ms apart")
        np.testing.assert_array_equal(runs["far"][rank]["ddp"], runs["far"][0]["ddp"])
        np.testing.assert_allclose(runs["far"][rank]["pipeline"], reference[rank], rtol=1e-5,
                                   atol=1e-6, err_msg=f"pipeline stage {rank} against one "
                                                      "process")
