"""A rank process for integration tests: ``python rank_script.py SCENARIO [ARGS]``.

Settings come from GRADSTAR_* env vars, as a launcher would set them. Prints one JSON line with
what it observed and exits 0, or prints the error and exits 3.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import gradstar
from gradstar.errors import GradstarError


def exact_inputs(rank: int, n: int) -> np.ndarray:
    # Integer-valued floats: sums are exact whatever order the hub folds ranks in.
    return (np.arange(n, dtype=np.float64) % 97 + rank).astype(np.float32)


def collectives(pg) -> dict:
    """Every collective once, checked exactly against what the other ranks must have sent."""
    r, w = pg.rank, pg.world_size
    n = 300_000  # > one 1 MiB chunk of float32
    checks = {}
    ref = sum(exact_inputs(k, n) for k in range(w))
    checks["all_reduce_sum"] = bool(np.array_equal(pg.all_reduce(exact_inputs(r, n)), ref))
    checks["all_reduce_max"] = bool(np.array_equal(
        pg.all_reduce(exact_inputs(r, n), op="max"), exact_inputs(w - 1, n)))
    checks["all_reduce_mean"] = bool(np.array_equal(
        pg.all_reduce(np.full(1000, float(r), np.float64), op="mean"),
        np.full(1000, (w - 1) / 2)))
    checks["all_reduce_prod_int"] = bool(np.array_equal(
        pg.all_reduce(np.full(10, r + 1, np.int64), op="prod"),
        np.full(10, np.prod(np.arange(1, w + 1)))))
    src = w - 1
    out = pg.broadcast(exact_inputs(r, n), src=src)
    checks["broadcast"] = bool(np.array_equal(out, exact_inputs(src, n)))
    gathered = pg.all_gather(exact_inputs(r, 5000))
    checks["all_gather"] = all(np.array_equal(gathered[k], exact_inputs(k, 5000)) for k in range(w))
    full = np.stack([exact_inputs(k, 4 * w * 1000).reshape(4 * w, 1000) for k in range(w)]).sum(0)
    shard = pg.reduce_scatter(exact_inputs(r, 4 * w * 1000).reshape(4 * w, 1000))
    checks["reduce_scatter"] = bool(np.array_equal(shard, full[4 * r:4 * (r + 1)]))
    pg.barrier()
    checks["barrier"] = True
    work = pg.all_reduce(np.array([r], np.int32), async_op=True)
    checks["async_op"] = int(work.wait(timeout=30)[0]) == sum(range(w))
    return {"rank": r, "checks": checks}


def small_collectives(pg) -> dict:
    """Small collectives of every dtype and op, checked exactly, and how many of them the
    blocking API ran on this thread (its direct lane) rather than on its loop."""
    r, w = pg.rank, pg.world_size
    lane = pg._group.direct
    before = 0 if lane is None else lane.completed
    checks, calls = {}, 0
    for dtype in ("float32", "float64", "float16", "bfloat16", "int32", "int64"):
        mine = (np.arange(1, 7) % 3 + r + 1).astype(np.float32)  # small ints: exact sums
        for op in ("sum", "min", "max", "prod") + (() if "int" in dtype else ("mean",)):
            x = _as_dtype(mine, dtype)
            got = np.asarray(pg.all_reduce(x, op=op), dtype=np.float64)
            rows = np.stack([(np.arange(1, 7) % 3 + k + 1) for k in range(w)]).astype(np.float64)
            want = {"sum": rows.sum(0), "min": rows.min(0), "max": rows.max(0),
                    "prod": rows.prod(0), "mean": rows.mean(0)}[op]
            checks[f"all_reduce {dtype} {op}"] = bool(np.array_equal(got, want))
            calls += 1
        x = _as_dtype(np.full(5, r + 1, np.float32), dtype)
        checks[f"broadcast {dtype}"] = bool(np.array_equal(
            np.asarray(pg.broadcast(x, src=w - 1), np.float64), np.full(5, w)))
        gathered = pg.all_gather(x)
        checks[f"all_gather {dtype}"] = all(np.array_equal(
            np.asarray(gathered[k], np.float64), np.full(5, k + 1)) for k in range(w))
        shard = pg.reduce_scatter(_as_dtype(np.arange(2 * w, dtype=np.float32) + r, dtype))
        want = sum(np.arange(2 * w) + k for k in range(w))[2 * r:2 * r + 2]
        checks[f"reduce_scatter {dtype}"] = bool(np.array_equal(
            np.asarray(shard, np.float64), want))
        calls += 3
    pg.barrier()
    calls += 1
    work = pg.all_reduce(np.array([r], np.int32), async_op=True)  # on the loop, as before
    checks["async_op"] = int(work.wait(timeout=30)[0]) == sum(range(w))
    return {"rank": r, "checks": checks, "calls": calls,
            "direct": None if lane is None else lane.completed - before}


def _as_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        import ml_dtypes
        return values.astype(ml_dtypes.bfloat16)
    return values.astype(dtype)


def small_mismatch(pg) -> dict:
    """A small all_reduce whose shape differs on the last rank: every rank must get the same
    named error; then a small all_reduce that agrees must work."""
    r, w = pg.rank, pg.world_size
    try:
        pg.all_reduce(np.ones(4 if r == w - 1 else 3, np.float32))
        error = None
    except GradstarError as failure:
        error = {"error": type(failure).__name__, "message": str(failure)}
    after = pg.all_reduce(np.full(3, r + 1, np.float32))
    return {"rank": r, "mismatch": error,
            "after": bool(np.array_equal(after, np.full(3, w * (w + 1) / 2)))}


def _failure(pg, error: GradstarError, rounds: int, started: float) -> dict:
    """What a rank reports when a call of its loop failed: the error, which rank it names, and
    how long the failed call took."""
    return {"rank": pg.rank, "rounds": rounds, "error": type(error).__name__,
            "message": str(error), "lost_rank": getattr(error, "rank", None),
            "seconds_in_failed_call": time.monotonic() - started, "failed_at": time.time()}


def allreduce_until_error(pg) -> dict:
    """All-reduce 8 MB (or ``sys.argv[2]`` float32 elements) repeatedly until a collective
    fails; report the error and its latency."""
    x = np.ones(int(sys.argv[2]) if len(sys.argv) > 2 else 2 << 20, np.float32)
    rounds = 0
    while True:
        started = time.monotonic()
        try:
            pg.all_reduce(x)
        except GradstarError as error:
            return _failure(pg, error, rounds, started)
        rounds += 1
        print(json.dumps({"progress": rounds}), flush=True)


def big_allreduce(pg) -> dict:
    """One all_reduce of ``sys.argv[2]`` MiB of float32, checked exactly."""
    mib = int(sys.argv[2])
    x = np.full(mib * (1 << 20) // 4, float(pg.rank + 1), np.float32)
    started = time.monotonic()
    out = pg.all_reduce(x)
    seconds = time.monotonic() - started
    want = float(sum(range(1, pg.world_size + 1)))
    return {"rank": pg.rank, "seconds": seconds,
            "exact": bool(out[0] == want and out[-1] == want and np.all(out == want)),
            "shared_memory": pg.shared_memory}


def uneven_all_to_all(pg) -> dict:
    """all_to_all_single with uneven (and empty) splits, checked exactly against a reference
    computed here; then splits that disagree between two ranks (every rank must raise the same
    named error); then a call that works."""
    r, w = pg.rank, pg.world_size
    sends = np.random.default_rng(0).integers(0, 5, size=(w, w))  # the same on every rank
    sends[0][w - 1] = sends[w - 1][w - 1] = 0

    def inputs(k: int) -> np.ndarray:  # 12 KB rows: splits of several 1 MiB chunks
        return (np.arange(sends[k].sum() * 3000, dtype=np.float32) % 1009 + 1000 * k).reshape(
            -1, 3000)

    out = pg.all_to_all_single(inputs(r), sends[:, r].tolist(), sends[r].tolist())
    ref = np.concatenate([inputs(k)[sends[k][:r].sum():sends[k][:r + 1].sum()]
                          for k in range(w)])
    checks = {"uneven": bool(out.shape == ref.shape and np.array_equal(out, ref))}
    expects = sends[:, r].tolist()
    if r == w - 1:
        expects[0] += 1  # rank w-1 expects one row more from rank 0 than it sends
    try:
        pg.all_to_all_single(np.ones((sends[r].sum(), 2)), expects, sends[r].tolist())
        mismatch = None
    except GradstarError as error:
        mismatch = [type(error).__name__, str(error)]
    got = pg.all_to_all([np.full(k + 1, 10 * r + k, np.int64) for k in range(w)])
    checks["after"] = [a.tolist() for a in got] == [[10 * k + r] * (r + 1) for k in range(w)]
    return {"rank": r, "checks": checks, "mismatch": mismatch}


def any_source(pg) -> dict:
    """Every rank but 0 sends rank 0 ``K`` messages on tag "m" all at once, and one on tag
    "other"; rank 0 receives all of "m" from any source, then "other" by rank."""
    r, w, k = pg.rank, pg.world_size, 25
    if r != 0:
        works = [pg.send(np.array([r, i], np.int64), 0, tag="m", async_op=True)
                 for i in range(k)]
        pg.send(np.array([r * 100]), 0, tag="other")
        for work in works:
            work.wait(timeout=60)
        pg.barrier()
        return {"rank": r}
    got = [pg.recv(None, tag="m") for _ in range(k * (w - 1))]
    others = [int(pg.recv(src, tag="other")[0]) for src in range(1, w)]
    pg.barrier()
    return {"rank": 0, "senders_named": all(int(x[0]) == src for src, x in got),
            "order": {str(src): [int(x[1]) for s, x in got if s == src] for src in range(1, w)},
            "others": others}


def finished_sender(pg) -> dict:
    """Rank 1 sends rank 0 two messages (the second not waited for) and closes its group while
    rank 0 waits for a third; rank 2 closes without ever sending. Rank 0 reports what each of
    its receives got or raised, and how long each failing one took."""
    r = pg.rank
    pg.barrier()
    if r == 1:
        time.sleep(0.3)  # rank 0 is waiting by now
        pg.send(np.arange(3), 0, tag="a")
        pg.send(np.arange(4), 0, tag="a", async_op=True)
        return {"rank": 1}
    if r != 0:
        time.sleep(0.6)
        return {"rank": r}
    report = {"rank": 0}

    def attempt(name, call):
        started = time.monotonic()
        try:
            report[name] = call().tolist()
        except GradstarError as error:
            report[name] = [type(error).__name__, str(error), getattr(error, "rank", None),
                            time.monotonic() - started]

    attempt("waiting", lambda: pg.recv(1, tag="never"))
    attempt("first", lambda: pg.recv(1, tag="a"))
    attempt("second", lambda: pg.recv(1, tag="a"))
    attempt("after", lambda: pg.recv(1, tag="a"))
    if pg.world_size > 2:
        attempt("silent", lambda: pg.recv(2, tag="x"))
    attempt("any", lambda: pg.recv(None, tag="y"))
    attempt("send", lambda: pg.send(np.ones(1), 1))
    return report


def recv_until_error(pg) -> dict:
    """Rank 1 sends rank 0 messages of 32 MiB, one after another, until it is killed (each one
    takes a good fraction of a second: a kill lands mid-message); rank 0 receives them, checked,
    until a receive fails, and reports the error."""
    x = np.arange(8 << 20, dtype=np.float32)
    rounds = 0
    while True:
        started = time.monotonic()
        try:
            if pg.rank == 1:
                pg.send(x + rounds, 0)
            else:
                got = pg.recv(1)
                if not np.array_equal(got, x + rounds):
                    return {"rank": pg.rank, "error": "wrong message", "rounds": rounds}
        except GradstarError as error:
            return _failure(pg, error, rounds, started)
        rounds += 1
        print(json.dumps({"progress": rounds}), flush=True)


def late_rank(pg) -> dict:
    """``late_rank SLOW DELAY ROUNDS``: a warm-up barrier (it takes what each rank's first
    collective costs, so that the measured rounds start together), then ``ROUNDS`` all_reduces,
    rank SLOW sleeping DELAY seconds before each; then the job's straggler summary as this rank
    reads it (once the hub shards' reports have caught up with the last collective) and, under
    ``durations``, how long each of its ROUNDS + 1 collectives took it (call to return,
    seconds): the hub cannot see a rank arrive later after the first one than that first one
    waited in the collective, so these bound the lags it measures."""
    slow, delay, rounds = int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    x = np.full(1000, float(pg.rank), np.float32)
    started = time.monotonic()
    pg.barrier()
    durations = [time.monotonic() - started]
    for _ in range(rounds):
        if pg.rank == slow:
            time.sleep(delay)
        started = time.monotonic()
        pg.all_reduce(x)
        durations.append(time.monotonic() - started)
    deadline = time.monotonic() + 10
    while True:
        stats = pg.straggler_stats()
        if all(r.collectives >= rounds + 1 for r in stats.ranks) or time.monotonic() > deadline:
            return {**stats.as_dict(), "durations": durations}
        time.sleep(0.2)


SCENARIOS = {"late_rank": late_rank, "collectives": collectives,
             "small_collectives": small_collectives, "small_mismatch": small_mismatch,
             "allreduce_until_error": allreduce_until_error, "big_allreduce": big_allreduce,
             "uneven_all_to_all": uneven_all_to_all,
             "any_source": any_source, "finished_sender": finished_sender,
             "recv_until_error": recv_until_error}


def main() -> int:
    scenario = SCENARIOS[sys.argv[1]]
    try:
        with gradstar.init_process_group(timeout=60, join_timeout=60) as pg:
            result = scenario(pg)
    except GradstarError as error:
        print(json.dumps({"fatal": type(error).__name__, "message": str(error)}), flush=True)
        return 3
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
