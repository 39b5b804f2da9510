"""LocalSGD and DiLoCo with ``gradstar.LocalSGD``: ranks train on their own data and meet every
``sync_every`` steps, when the coordinator averages them into the job's global model.

    gradstar launch --nproc 2 examples/local_sgd.py             # parameters averaged
    gradstar launch --nproc 2 examples/local_sgd.py --diloco    # DiLoCo: outer Nesterov step
    gradstar launch --nproc 2 examples/local_sgd.py --diloco --wire int4   # 4-bit outer grads

With ``--diloco`` ranks send pseudo-gradients (global parameters of the last round minus their
own) and the coordinator applies the outer Nesterov step to the global model. The run ends on a
round, so every rank holds the global model: compare the ``sha256`` of the lines they print.
"""

import argparse
import hashlib

import torch
from torch import nn

import gradstar

parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
parser.add_argument("--diloco", action="store_true", help="outer Nesterov step on the hub")
parser.add_argument("--sync-every", type=int, default=8, help="local steps between rounds")
parser.add_argument("--rounds", type=int, default=6)
parser.add_argument("--wire", help="DiLoCo: a compressed wire format for the pseudo-gradients "
                    "(bf16, fp16, int8, int4)")
args = parser.parse_args()

g = torch.Generator().manual_seed(0)
X = torch.randn(1024, 8, generator=g)
Y = X.sum(dim=1, keepdim=True) + 0.1 * torch.randn(1024, 1, generator=g)


def full_loss(model: nn.Module) -> float:
    with torch.no_grad():
        return nn.functional.mse_loss(model(X), Y).item()


with gradstar.init_process_group() as pg:
    torch.manual_seed(pg.rank)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    if args.diloco:  # DiLoCo's usual pair: AdamW inside, Nesterov momentum outside
        lsgd = gradstar.LocalSGD(model, pg, sync_every=args.sync_every,
                                 outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9,
                                 wire=args.wire)
        opt = torch.optim.AdamW(model.parameters(), lr=0.03)
    else:
        lsgd = gradstar.LocalSGD(model, pg, sync_every=args.sync_every)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # LocalSGD started every rank from the global model (rank 0's parameters, the first time).
    before = full_loss(model)

    # This rank's own data: every world_size-th row; it never sees the other ranks' rows.
    x_mine, y_mine = X[pg.rank::pg.world_size], Y[pg.rank::pg.world_size]
    for step in range(args.rounds * args.sync_every):
        rows = torch.arange(step * 32, (step + 1) * 32) % len(x_mine)
        opt.zero_grad()
        nn.functional.mse_loss(model(x_mine[rows]), y_mine[rows]).backward()
        opt.step()
        lsgd.step()  # counts local steps; every sync_every-th call runs a round

    after = full_loss(model)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(params.numpy().tobytes()).hexdigest()[:16]
    mode = "diloco" if args.diloco else "local_sgd"
    print(f"{mode}: rank {pg.rank} of {pg.world_size}: loss {before:.4f} -> {after:.4f} after "
          f"{lsgd.rounds} rounds of {args.sync_every} steps; parameters sha256 {digest}",
          flush=True)
