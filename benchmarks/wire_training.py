"""Training accuracy with compressed gradients: gradstar.DDP with float32 buckets vs a wire format
with and without error feedback.

What is measured
    The demo's task and model (``gradstar.worker.demo.spirals``: 3 spiral arms, 24,000 points, a
    3-layer SiLU MLP of 128 units) trained by ``--ranks`` spawned processes with
    ``gradstar.DDP(model, pg, wire=W, error_feedback=E)`` and SGD with momentum 0.9, each rank
    on its share of every global batch (the same schedule for every configuration: a seeded
    permutation per epoch). Each configuration gets a fresh coordinator on 127.0.0.1; all start
    from the same initialisation. The table shows the final training loss (mean of the last
    epoch's steps, rank 0) and the full test set's cross-entropy and accuracy; the ranks must
    end with identical parameters (checked). Accuracy, not time: nothing here is timed.

How to reproduce
    .venv/bin/python benchmarks/wire_training.py                    # 4 ranks, 8 epochs
    .venv/bin/python benchmarks/wire_training.py --ranks 2 --epochs 4 --wires int8
"""

from __future__ import annotations

import argparse
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _collective_runs import coordinator
from _harness import BenchmarkError, format_table
from _ranks import run_ranks

from gradstar.wire.formats import FORMATS


def train_rank(rank: int, world_size: int, address: str, job: str, wire: str | None,
               error_feedback: bool, epochs: int, batch: int, lr: float, samples: int) -> dict:
    import numpy as np
    import torch

    import gradstar
    from gradstar.worker.demo.spirals import evaluate, flat_parameters, make_model, make_spirals

    torch.set_num_threads(1)  # the ranks share the machine's cores with the hub
    data = make_spirals(samples, seed=0)
    with gradstar.init_process_group(coordinator=address, job=job, world_size=world_size,
                                     rank=rank, timeout=60, join_timeout=60) as pg:
        model = gradstar.DDP(make_model(data.features, data.classes), pg, wire=wire,
                             error_feedback=error_feedback if wire else None)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        x, y = torch.from_numpy(data.train.x), torch.from_numpy(data.train.y)
        global_batch = batch * world_size
        steps = len(data.train) // global_batch
        losses: list[float] = []
        for epoch in range(epochs):
            order = torch.from_numpy(np.random.Generator(np.random.PCG64([0, epoch]))
                                     .permutation(len(data.train)))
            losses = []
            for step in range(steps):
                rows = order[step * global_batch:(step + 1) * global_batch]
                mine = rows[rank * batch:(rank + 1) * batch]
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x[mine]), y[mine])
                loss.backward()
                opt.step()
                losses.append(loss.item())
        test_loss, accuracy, _ = evaluate(model.module, data.test)
        params = flat_parameters(model.module)
        pg.barrier()
    return {"train_loss": float(np.mean(losses)), "test_loss": test_loss, "accuracy": accuracy,
            "digest": float(np.abs(params).sum()), "steps": steps * epochs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="DDP accuracy with compressed gradients.")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="rows per rank per step")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--samples", type=int, default=24_000)
    parser.add_argument("--wires", nargs="+", default=["int8", "int4"], choices=list(FORMATS),
                        help="formats to run with and without error feedback")
    args = parser.parse_args(argv)

    configs = [(None, False)] + [(w, ef) for w in args.wires for ef in (True, False)]
    rows = []
    for wire, ef in configs:
        label = "float32" if wire is None else f"{wire} {'+ EF' if ef else 'no EF'}"
        with coordinator(0, {}) as coord:
            results = run_ranks(train_rank, args.ranks,
                                (coord.address, f"wire-train-{uuid.uuid4().hex[:8]}", wire, ef,
                                 args.epochs, args.batch, args.lr, args.samples),
                                timeout=1800, label=label)
        if len({r["digest"] for r in results}) != 1:
            raise BenchmarkError(f"[{label}] the ranks ended with different parameters")
        r = results[0]
        rows.append([label, f"{r['train_loss']:.4f}", f"{r['test_loss']:.4f}",
                     f"{100 * r['accuracy']:.2f}"])
        print(f"{label}: {rows[-1][1:]} after {r['steps']} steps", flush=True)
    print(f"\n{args.ranks} ranks, {args.epochs} epochs, batch {args.batch}/rank, lr {args.lr}")
    print(format_table(["gradients", "train loss (last epoch)", "test loss",
                        "test accuracy %"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
