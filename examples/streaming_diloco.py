"""Streaming DiLoCo with ``gradstar.StreamingDiLoCo``: replicas train on their own data; the
model's 3 fragments meet on the hub on staggered schedules, each round overlapping ``--delay``
inner steps of training.

    gradstar launch --nproc 3 examples/streaming_diloco.py

Each process is a replica (named after its rank); no process group is formed, so a replica
that dies only drops out of the rounds it misses, and one that starts late catches up from the
hub. At the end every replica holds the same global model: compare the ``sha256`` it prints.
"""

import argparse
import hashlib
import os

import torch
from torch import nn

import gradstar

parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
parser.add_argument("--sync-every", type=int, default=12, help="H: steps between a fragment's "
                    "rounds")
parser.add_argument("--fragments", type=int, default=3, help="P")
parser.add_argument("--delay", type=int, default=2, help="tau: steps a round overlaps")
parser.add_argument("--steps", type=int, default=96)
args = parser.parse_args()

g = torch.Generator().manual_seed(0)
X = torch.randn(1024, 8, generator=g)
Y = X.sum(dim=1, keepdim=True) + 0.1 * torch.randn(1024, 1, generator=g)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                      nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
# gradstar launch numbers the processes as it does ranks: replica names and data slices.
index = int(os.environ.get("GRADSTAR_RANK", "0"))
count = int(os.environ.get("GRADSTAR_WORLD_SIZE", "1"))
# min_replicas=count: rounds wait for every replica (a fast one would otherwise finish alone
# before the others started); past round_timeout a round closes without a dead one only if
# at least min_replicas contributed, so lower it to train on through failures.
with gradstar.StreamingDiLoCo(model, sync_every=args.sync_every, fragments=args.fragments,
                              delay=args.delay, alpha=0.5, outer_lr=0.7, outer_momentum=0.9,
                              min_replicas=count) as sdl:
    before = nn.functional.mse_loss(model(X), Y).item()
    torch.manual_seed(1 + index)  # this replica's own batches of its own rows
    x_mine, y_mine = X[index::count], Y[index::count]
    while sdl.local_steps < args.steps:
        batch = torch.randint(0, len(x_mine), (32,))
        opt.zero_grad()
        nn.functional.mse_loss(model(x_mine[batch]), y_mine[batch]).backward()
        opt.step()
        sdl.step()
    sdl.finish()
    digest = hashlib.sha256(sdl.global_parameters.tobytes()).hexdigest()[:16]
    with torch.no_grad():
        after = nn.functional.mse_loss(model(X), Y).item()
    print(f"streaming_diloco: rank {index} of {count}: replica {sdl.replica}, rounds "
          f"{sdl.rounds}, loss {before:.3f} -> {after:.3f}, global sha256 {digest}", flush=True)
