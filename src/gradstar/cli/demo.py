"""``gradstar demo``: the main job, a model trained across local worker processes, and its
report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gradstar.cli.common import USAGE_ERROR


def demo_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from gradstar.worker.demo.command import MODES, DemoOptions

    d = DemoOptions()
    p = sub.add_parser(
        "demo", help="the main job: train a model across local worker processes and report",
        allow_abbrev=False,
        description="Start an embedded coordinator and WORKERS rank processes that train an MLP "
                    "on a generated spirals dataset, then report accuracy, throughput, bytes "
                    "through the hub and whether the result matches a single-process run.")
    p.add_argument("--workers", type=int, default=d.workers,
                   help=f"rank processes (default {d.workers})")
    p.add_argument("--mode", choices=MODES, default=d.mode, help=f"default {d.mode}")
    p.add_argument("--epochs", type=int, default=d.epochs, help=f"default {d.epochs}")
    p.add_argument("--samples", type=int, default=d.samples,
                   help=f"dataset size, train + test (default {d.samples})")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help=f"rows per rank and step (default {d.batch_size})")
    p.add_argument("--hidden", type=int, default=d.hidden, help=f"default {d.hidden}")
    p.add_argument("--lr", type=float, default=d.lr, help=f"default {d.lr}")
    p.add_argument("--sync-every", type=int, default=d.sync_every,
                   help=f"localsgd: steps between averaging rounds (default {d.sync_every})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"default {d.seed}")
    p.add_argument("--plot", type=Path, metavar="FILE.png",
                   help="also draw loss and test accuracy per epoch into this PNG (needs "
                        "matplotlib: pip install 'gradstar[plot]')")
    p.add_argument("--report", type=Path, metavar="FILE.json",
                   help="also write the report as JSON: per epoch, result, throughput, bytes "
                        "through the hub, the match with one process")
    return p


def demo_command(args: argparse.Namespace) -> int:
    from gradstar.worker.demo.command import DemoOptions, run_demo

    if args.workers < 1:
        print("gradstar demo: --workers must be at least 1", file=sys.stderr)
        return USAGE_ERROR
    return run_demo(DemoOptions(workers=args.workers, mode=args.mode, epochs=args.epochs,
                                samples=args.samples, batch_size=args.batch_size,
                                hidden=args.hidden, lr=args.lr, sync_every=args.sync_every,
                                seed=args.seed, plot=args.plot, report=args.report))
