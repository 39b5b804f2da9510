"""A LocalSGD / DiLoCo rank for tests: ``python local_sgd_script.py SCENARIO OUT_DIR [...]``.

Settings come from GRADSTAR_* env vars. Writes .npy files of flat parameters into OUT_DIR and
prints one JSON line per completed round.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

import gradstar
from gradstar.errors import GradstarError

IN, HIDDEN, BATCH = 8, 16, 32


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, 1, generator=g)


def flat(model: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def local_step(model, opt, step: int, rank: int, world: int) -> None:
    x, y = batch(step)
    loss = nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])
    opt.zero_grad()
    loss.backward()
    opt.step()


def make_optimizer(model, inner: str):
    if inner == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.1)


def train(args) -> None:
    """Ranks start from different inits; LocalSGD aligns them and trains ``--steps`` steps."""
    args.out.mkdir(parents=True, exist_ok=True)
    with gradstar.init_process_group(timeout=60, join_timeout=60) as pg:
        model = make_model(100 + pg.rank)
        outer = None if args.outer == "none" else args.outer
        lsgd = gradstar.LocalSGD(model, pg, args.sync_every, outer_optimizer=outer,
                                 outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                                 wire=args.wire)
        np.save(args.out / f"start{pg.rank}.npy", flat(model))
        opt = make_optimizer(model, args.inner)
        for step in range(args.steps):
            local_step(model, opt, step, pg.rank, pg.world_size)
            if lsgd.step():
                print(json.dumps({"round": lsgd.rounds}), flush=True)
        np.save(args.out / f"final{pg.rank}.npy", flat(model))


def resilient(args) -> None:
    """Sync every step; after losing a peer, re-join and do ``--after-resume`` more rounds.

    The first membership runs up to ``--rounds`` rounds. ``--fresh-seed`` starts from another
    random model and counts as resumed from the start, as a restarted process would.
    """
    restarted = args.fresh_seed is not None
    model = make_model(args.fresh_seed if restarted else 100)
    done, target, resumed = 0, args.after_resume if restarted else args.rounds, restarted
    while done < target:
        with gradstar.init_process_group(timeout=30, join_timeout=60) as pg:
            rank, world = pg.rank, pg.world_size
            lsgd = gradstar.LocalSGD(model, pg, 1)
            if resumed:
                np.save(args.out / f"resumed{rank}.npy", flat(model))
            opt = make_optimizer(model, "sgd")
            try:
                while done < target:
                    local_step(model, opt, done, rank, world)
                    lsgd.step()
                    done += 1
                    phase = "after" if resumed else "round"
                    np.save(args.out / f"{phase}{done}_rank{rank}.npy", flat(model))
                    print(json.dumps({"round": done, "rank": rank}), flush=True)
            except GradstarError as error:
                print(json.dumps({"lost": type(error).__name__, "message": str(error)}),
                      flush=True)
                resumed, done, target = True, 0, args.after_resume
    np.save(args.out / f"final{rank}.npy", flat(model))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["train", "resilient"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--sync-every", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--after-resume", type=int, default=3)
    parser.add_argument("--inner", default="sgd")
    parser.add_argument("--outer", default="none")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--fresh-seed", type=int)
    parser.add_argument("--wire", help="a wire format for the pseudo-gradients")
    args = parser.parse_args()
    {"train": train, "resilient": resilient}[args.scenario](args)


if __name__ == "__main__":
    main()
