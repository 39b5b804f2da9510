"""A Synchronous DDP rank of a job that grows and shrinks while it trains, for
``test_resize.py``: ``python resize_script.py IDENT [--leaver] [--joiner] [--resizes N]
[--other-model]`` (settings from GRADSTAR_* env vars).

Every rank trains the same MLP (SGD with momentum) on data picked by (step, IDENT), where IDENT
names the process, not its rank (ranks are renumbered when one leaves). The schedule, which every
rank follows from what it sees:

1. the first ranks train until the job grows (a joiner started with ``--joiner``);
2. two steps after that resize, the ``--leaver`` rank asks to leave; everyone trains on, the
   leaver until ``ddp.elastic.left``;
3. three steps after the last resize (``--resizes``, default 2) every rank stops.

A joiner with ``--other-model`` has another hidden width: the state it is sent does not fit, so
it leaves again at the boundary it joined at (its constructor raises ``ProtocolError``, which
it prints as ``{"refused": ...}``) and the others go on, undisturbed.

Each rank prints one JSON line per step it ran (``{"step", "ident", "world"}``), one per resize
it moved through, and a last line with its final parameters, so that the test can replay the
whole run in one process.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

import gradstar
from gradstar.errors import ProtocolError

SCRIPT = Path(__file__)
IN, HIDDEN, OUT, BATCH = 5, 12, 2, 8
LR, MOMENTUM = 0.05, 0.9
#: Most steps the first ranks wait for the joiner before they give up.
MAX_WAIT_STEPS = 3000


def make_model(seed: int, hidden: int = HIDDEN) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, hidden), nn.Tanh(), nn.Linear(hidden, OUT))


def batch(step: int, ident: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + ident)
    x = torch.randn(BATCH, IN, generator=g)
    return x, torch.randn(BATCH, OUT, generator=g)


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("ident", type=int)
    parser.add_argument("--leaver", action="store_true")
    parser.add_argument("--joiner", action="store_true")
    parser.add_argument("--resizes", type=int, default=2)
    parser.add_argument("--other-model", action="store_true")
    args = parser.parse_args()
    pg = gradstar.init_process_group()
    # Only the broadcast (or the snapshot) aligns them.
    model = make_model(100 + args.ident, HIDDEN + 1 if args.other_model else HIDDEN)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    try:
        ddp = gradstar.DDP(model, pg, optimizer=opt)
    except ProtocolError as error:
        emit({"refused": str(error), "ident": args.ident})
        return 3
    resizes: list = []
    ddp.elastic.on_resize(resizes.append)
    seen = 1 if args.joiner else 0
    boundaries = [pg.joined.boundary] if args.joiner else []
    step = pg.steps_begun
    asked = False
    while True:
        if args.leaver and seen == 1 and step == boundaries[0] + 2 and not asked:
            ddp.elastic.leave()
            asked = True
        if ddp.elastic.left:
            emit({"left_at": step, "ident": args.ident})
            break
        if seen == 0 and step >= MAX_WAIT_STEPS:
            print("the job never grew", file=sys.stderr)
            return 2
        if seen == args.resizes and step >= boundaries[-1] + 3:
            break
        x, y = batch(step, args.ident)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        for r in resizes[seen - (1 if args.joiner else 0):]:
            assert r.boundary == step, (r, step)  # it moved before this step's collectives
            emit({"resize": r.boundary, "world": r.world_size, "rank": r.rank,
                  "newcomers": list(r.newcomers), "ident": args.ident})
            boundaries.append(r.boundary)
            seen += 1
        emit({"step": step, "ident": args.ident, "world": pg.world_size, "rank": pg.rank,
              "t": time.time()})
        step += 1
        if seen == 0:
            time.sleep(0.01)  # the first ranks idle a little while the joiner starts
    if not ddp.elastic.left:
        emit({"params": [p.detach().reshape(-1).tolist() for p in model.parameters()],
              "ident": args.ident, "world": pg.world_size, "generation": pg.generation})
    closing = time.time()
    pg.close()
    emit({"closed": time.time() - closing, "ident": args.ident})
    return 0


if __name__ == "__main__":
    sys.exit(main())
