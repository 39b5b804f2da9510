"""A LocalSGD / DiLoCo rank for tests: ``python local_sgd_script.py SCENARIO OUT_DIR [...]``.

Settings come from GRADSTAR_* env vars. Writes .npy files of flat parameters into OUT_DIR and
prints one JSON line per completed round.
"""

from __future__ import annotations

import argparse
import json
import time
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


def ident_step(model, opt, step: int, ident: int) -> None:
    """One inner step on process ``ident``'s own data (the same whatever its rank)."""
    g = torch.Generator().manual_seed(1000 * ident + step)
    x, y = torch.randn(8, IN, generator=g), torch.randn(8, 1, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def elastic(args) -> None:
    """DiLoCo in a job that grows and shrinks (GRADSTAR_MAX_WORLD_SIZE): the process
    ``--ident`` trains on its own data. The first ranks wait for the file ``--go`` before
    their step ``--wait-at`` (they make ``OUT/waitingIDENT`` there; the test makes ``--go``
    once a joiner waits at the hub). A joiner
    (``--ident`` past the first world size, elastic) creates ``OUT/joined`` once in; process
    ``--leaver`` calls leave() once it moved with the newcomer. Prints one JSON line per round
    ({"round", "ident", "rank", "world"}); the ranks that stay save their final parameters."""
    args.out.mkdir(parents=True, exist_ok=True)
    with gradstar.init_process_group(timeout=60, join_timeout=120) as pg:
        model = make_model(100 + args.ident)
        lsgd = gradstar.LocalSGD(model, pg, args.sync_every, outer_optimizer="nesterov",
                                 outer_lr=0.7, outer_momentum=0.9)
        if pg.newcomer:
            (args.out / "joined").touch()
            print(json.dumps({"joined": lsgd.rounds, "steps": lsgd.local_steps,
                              "ident": args.ident}), flush=True)
        opt = make_optimizer(model, "sgd")
        while lsgd.local_steps < args.steps and not lsgd.left:
            if lsgd.local_steps == args.wait_at and not pg.newcomer:
                (args.out / f"waiting{args.ident}").touch()
                deadline = time.monotonic() + 120
                while not args.go.exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
            ident_step(model, opt, lsgd.local_steps, args.ident)
            if lsgd.step():
                print(json.dumps({"round": lsgd.rounds, "ident": args.ident, "rank": pg.rank,
                                  "world": pg.world_size}), flush=True)
                if args.ident == args.leaver and lsgd.elastic.last is not None:
                    lsgd.leave()
        print(json.dumps({"left": lsgd.left, "ident": args.ident}), flush=True)
        if not lsgd.left:
            np.save(args.out / f"final{args.ident}.npy", flat(model))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["train", "resilient", "elastic"])
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
    parser.add_argument("--ident", type=int, default=0)
    parser.add_argument("--leaver", type=int, default=-1)
    parser.add_argument("--wait-at", type=int, default=-1)
    parser.add_argument("--go", type=Path)
    args = parser.parse_args()
    {"train": train, "resilient": resilient, "elastic": elastic}[args.scenario](args)


if __name__ == "__main__":
    main()
