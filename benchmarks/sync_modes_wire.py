"""What a wire format saves in the sync modes (issue 32): bytes per step per rank, up and down,
and what the hub holds per logged aggregate.

What is measured
    A coordinator in this process (127.0.0.1:0) and ``--ranks`` Steps clients of one ledger in
    Quorum(min_ranks=ranks): each of ``--steps`` steps every rank contributes a Gaussian
    gradient of ``--numel`` values (no error feedback: one step's rounding is what is shown),
    then fetches the step's aggregate. Per format: payload bytes each rank sent and received per
    step (the clients' counters: what crossed its link, headers aside), the hub's held bytes
    per logged aggregate, and the relative L2 error of the aggregate a rank applies against the
    float32 mean of the gradients.

How to reproduce
    .venv/bin/python benchmarks/sync_modes_wire.py --numel 1048576 --steps 4
"""

from __future__ import annotations

import argparse
import asyncio

import numpy as np

import gradstar
from gradstar.client.steps import StepsClient
from gradstar.config import CoordinatorSettings
from gradstar.coordinator import Coordinator
from gradstar.sync_modes import Quorum
from gradstar.wire.formats import FORMATS

T = 60.0  # every call's deadline


async def measure(name: str, numel: int, ranks: int, steps: int) -> dict:
    fmt = FORMATS.get(name)
    hub = Coordinator(CoordinatorSettings(host="127.0.0.1", port=0))
    await hub.start()
    # The Steps service takes calls from the job's members only: join them first.
    groups = sorted(await asyncio.gather(*(
        gradstar.init_process_group_async(coordinator=hub.address, job=f"w-{name}",
                                          world_size=ranks, rank=rank, timeout=T)
        for rank in range(ranks))), key=lambda g: g.rank)
    clients = [StepsClient.for_group(pg, "m") for pg in groups]
    mode, errors = Quorum(min_ranks=ranks), []
    try:
        for step in range(steps):
            rng = np.random.default_rng(step)
            grads = [rng.standard_normal(numel).astype(np.float32) for _ in clients]
            await asyncio.gather(*(c.contribute(mode, 0, step, 1.0, g, T, wire=fmt)
                                   for c, g in zip(clients, grads, strict=True)))
            got = await asyncio.gather(*(c.fetch(step, step + 1, T) for c in clients))
            mean = np.mean(grads, axis=0, dtype=np.float64)
            errors.append(np.linalg.norm(got[0].values[0] - mean) / np.linalg.norm(mean))
        ledger = hub.steps.ledgers[(f"w-{name}", "m")]
        held = hub.steps.held_bytes / len(ledger.log)
    finally:
        for c in clients:
            await c.close()
        await asyncio.gather(*(pg.close() for pg in groups))
        await hub.stop(grace=0)
    return {"format": name, "sent": clients[0].bytes_sent / steps,
            "received": clients[0].bytes_received / steps, "held": held,
            "error": float(np.mean(errors))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    print(f"{args.numel} values, {args.ranks} ranks, Quorum(min_ranks={args.ranks}), "
          f"{args.steps} steps; bytes per step per rank")
    print("| format | sent | received | hub per aggregate | vs float32 | aggregate rel. L2 error |")
    print("|---|---|---|---|---|---|")
    base = None
    for name in ["float32", *FORMATS]:
        row = asyncio.run(measure(name, args.numel, args.ranks, args.steps))
        base = base or row["sent"]
        print(f"| {name} | {row['sent']:.0f} | {row['received']:.0f} | {row['held']:.0f} | "
              f"{row['sent'] / base:.3f} | {row['error']:.2e} |")


if __name__ == "__main__":
    main()
