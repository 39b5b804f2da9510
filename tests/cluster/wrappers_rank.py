"""A rank of the outbound-only hosts test's wrappers job, started by ``gradstar worker`` on a
host of the emulated cluster (``python -m tests.cluster.wrappers_rank OUT_DIR``), one rank a
host. It trains with every wrapper in turn, a few steps each, on data picked by (rank, step):

* DDP and FSDP over the same MLP (SGD), their gradients reduced across the hosts;
* a Pipeline with one stage per host (1F1B, 4 micro-batches): activations and gradients
  stream between the hosts, to outbound-only ones through the coordinator's relay;
* Streaming DiLoCo (every rank a replica, 2 fragments): its rounds go to the coordinator.

Reports ``OUT_DIR/wrappers-RANK.json``: each wrapper's final parameters, and the shards the
job striped over. The test runs it on reachable hosts and on outbound-only ones and compares.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import gradstar
from tests.cluster.report import write_report

IN, HIDDEN, OUT, STEPS = 6, 16, 3, 3


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def batch(rank: int, step: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(rows, IN, generator=g), torch.randn(rows, OUT, generator=g)


def flat(module: nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).tolist()


def data_parallel(wrapper, rank: int) -> None:
    opt = torch.optim.SGD(wrapper.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(wrapper(x), y).backward()
        opt.step()


def pipeline(pg) -> list[float]:
    torch.manual_seed(1 + pg.rank)
    width = [IN, HIDDEN, HIDDEN, OUT]
    stage = nn.Sequential(nn.Linear(width[pg.rank], width[pg.rank + 1]), nn.Tanh())
    pipe = gradstar.Pipeline(stage, pg, num_microbatches=4, schedule="1f1b")
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = batch(0, step, rows=16)
        opt.zero_grad()
        pipe.step(inputs=x if pipe.is_first else None, targets=y if pipe.is_last else None,
                  loss_fn=nn.functional.mse_loss)
        opt.step()
    return flat(stage)


def streaming_diloco(rank: int) -> list[float]:
    model = mlp()
    with gradstar.StreamingDiLoCo(model, sync_every=2, fragments=2, min_replicas=3,
                                  round_timeout=60.0, timeout=120.0,
                                  replica=f"r{rank}") as sdl:
        while sdl.local_steps < 4 * STEPS:
            x, y = batch(rank, sdl.local_steps)
            model.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.05 * p.grad
            sdl.step()
        sdl.finish()
    return flat(model)


def main() -> None:
    out = Path(sys.argv[1])
    with gradstar.init_process_group(timeout=120) as pg:
        report = {"rank": pg.rank, "shards": list(pg.shards)}
        ddp = gradstar.DDP(mlp(), pg)
        data_parallel(ddp, pg.rank)
        report["ddp"] = flat(ddp.module)
        fsdp = gradstar.FSDP(mlp(), pg)
        data_parallel(fsdp, pg.rank)
        full = fsdp.full_state_dict(rank0_only=False)
        report["fsdp"] = torch.cat([v.reshape(-1) for v in full.values()]).tolist()
        report["pipeline"] = pipeline(pg)
        pg.barrier()
    report["streaming_diloco"] = streaming_diloco(report["rank"])
    write_report(out, "wrappers", report["rank"], report)


if __name__ == "__main__":
    main()
