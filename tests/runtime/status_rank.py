"""A rank for the status page test: ``python status_rank.py ROUNDS FLOATS LATE``.

ROUNDS all_reduces of FLOATS float32 values, rank 1 arriving LATE seconds after the others at
each (the straggler the page must show); then it prints ``ready`` and waits for a line on stdin
(the test looks at the page meanwhile) before it passes a barrier and closes its group."""

from __future__ import annotations

import sys
import time

import numpy as np

import gradstar


def main() -> None:
    rounds, floats, late = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    with gradstar.init_process_group(timeout=60, join_timeout=30) as pg:
        x = np.ones(floats, np.float32)
        for _ in range(rounds):
            if pg.rank == 1:
                time.sleep(late)
            pg.all_reduce(x)
        print("ready", flush=True)
        sys.stdin.readline()  # EOF too: a test that went away must not leave this waiting
        pg.barrier()  # nobody closes while another rank still needs the generation
    print("closed", flush=True)


if __name__ == "__main__":
    main()
