"""gradstar.DDP in sync modes with 4 real rank processes and a real coordinator: replicas end
bitwise identical, they equal a one-process replay of the hub's record of which contribution
joined which step, staleness stays within each mode's bound, weights weigh, and a rank that
dies or stalls holds nobody. Delays are injected per rank (``sync_modes_script.py --delays``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys

import numpy as np
import pytest

from gradstar.config import CoordinatorSettings
from gradstar.coordinator import Coordinator
from tests.integration.conftest import until

from . import sync_modes_script as script
from .conftest import finish, kill_all, rank_env, rank_lines

WORLD = 4


async def run_modes(*args: str, stopped: int = -1, restart: bool = False,
                    timeout: float = 90, grow: bool = False) -> dict[int, dict]:
    """A coordinator (8 s heartbeat timeout: a stalled rank leaves the live sets within the test,
    and a rank of a loaded machine is not taken for a stalled one) and
    WORLD ranks of the script; each rank's report by rank, with its ``contributions`` (the
    lines it printed after each backward). Rank ``stopped`` kills or stops itself (the script's
    --stop-rank): it is killed at the end and reports its contributions only; with
    ``restart`` a new process takes its place as soon as it died (an elastic join, as the agent
    restarts it; the --stop-* arguments come last, and it runs without them) and reports as
    that rank, with both processes' contributions. With ``grow`` the job may grow by one
    (GRADSTAR_MAX_WORLD_SIZE) and one more process joins it, elastic and without a rank, once
    its generation formed; it reports as rank WORLD."""
    hub = Coordinator(CoordinatorSettings(host="127.0.0.1", port=0, heartbeat_timeout=8.0))
    await hub.start()
    procs = []

    def start(rank: int, argv) -> asyncio.Future:
        env = rank_env(hub.address, "modes", WORLD, rank, GRADSTAR_ELASTIC="1",
                       GRADSTAR_MAX_WORLD_SIZE=WORLD + grow)
        if rank >= WORLD:
            del env["GRADSTAR_RANK"]  # the hub gives it the next one
        return asyncio.create_subprocess_exec(
            sys.executable, str(script.SCRIPT), *argv, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)

    try:
        for rank in range(WORLD):
            procs.append(await start(rank, args))
        if grow:
            await until(lambda: getattr(hub.rendezvous.jobs.get("modes"), "generation", None),
                        "the job's generation formed", timeout)
            procs.append(await start(WORLD, args))
        first_life, restarted = "", stopped if restart else -1
        if restart:
            out, _ = await asyncio.wait_for(procs[stopped].communicate(), timeout)
            first_life = out.decode()
            procs[stopped] = await start(stopped, args[:args.index("--stop-rank")])
            stopped = -1
        survivors = [p for r, p in enumerate(procs) if r != stopped]
        results = await asyncio.gather(*(finish(p, timeout) for p in survivors),
                                       return_exceptions=True)
        leftover = ""
        if stopped >= 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(procs[stopped].pid, signal.SIGKILL)
            out, _ = await asyncio.wait_for(procs[stopped].communicate(), 20)
            leftover = out.decode()
    finally:
        await kill_all(procs)
        await hub.stop(grace=0)
    ranks = [r for r in range(WORLD + grow) if r != stopped]
    lines = {r: rank_lines(r, res) for r, res in zip(ranks, results, strict=True)}
    if first_life:
        lines[restarted] = [json.loads(line) for line in first_life.splitlines()
                            if line.startswith("{")] + lines[restarted]
    if stopped >= 0:
        lines[stopped] = [json.loads(line) for line in leftover.splitlines()
                          if line.startswith("{")]
    reports = {}
    for rank, printed in sorted(lines.items()):
        final = [line for line in printed if "params" in line]
        reports[rank] = final[-1] if final else {"rank": rank, "stopped": True}
        reports[rank]["contributions"] = [line["contribution"] for line in printed
                                          if "contribution" in line]
    return reports


def record(reports: dict[int, dict]) -> list[dict]:
    """The hub's record of every step, from the finished ranks' (see ``script.full_record``)."""
    return script.full_record({rank: r["steps"] for rank, r in reports.items() if "params" in r})


def assert_identical_and_replayed(reports: dict[int, dict], rtol=1e-6, atol=1e-7,
                                  wire: str | None = None, batchnorm: bool = False) -> dict:
    """Every rank the same parameters, bit for bit, after synchronize(); the same steps; and
    those parameters are what one process gets by replaying the hub's record (in ``wire``);
    the replay's residual per rank (with ``wire``)."""
    finished = {rank: r for rank, r in reports.items() if "params" in r}
    first = next(r for r in finished.values() if not r["replacement"])
    for rank, report in finished.items():
        assert report["params"] == first["params"], f"rank {rank} differs"
    steps = record(finished)
    contributions = {rank: r["contributions"] for rank, r in reports.items()}
    residuals: dict = {}
    replayed = script.params_of(script.replay(contributions, steps, wire, residuals,
                                              batchnorm))
    for name, values in replayed.items():
        np.testing.assert_allclose(first["params"][name], values, rtol=rtol, atol=atol,
                                   err_msg=name)
    return residuals


def assert_default_scaling(steps: list[dict], live: int = WORLD) -> None:
    """Every step the ranks applied was scaled by the default rule, computed here by hand from
    the record: each contribution's weight over the step's weights, times the step's share of
    the ``live`` ranks (its contributions over ``live``), over 1 + its staleness, as float32."""
    for step in steps:
        weights = step["weights"]
        by_hand = [w / sum(weights) * len(weights) / live / (1 + s)
                   for w, s in zip(weights, step["staleness"], strict=True)]
        np.testing.assert_allclose(step["factors"], np.float32(by_hand), rtol=1e-7,
                                   err_msg=f"step {step['step']}")
    assert any(len(step["ranks"]) < live for step in steps)  # some step was a partial one


@pytest.fixture(scope="module")
def quorum_run() -> dict[int, dict]:
    # Rank 3 is slow: its gradients arrive after the other three closed their steps.
    return asyncio.run(run_modes("quorum", "--min-ranks", "3", "--timeout", "0.02",
                                 "--delays", "0,0,0,0.3", "--steps", "10"))


def test_quorum_replicas_identical_and_equal_the_replay(quorum_run):
    assert_identical_and_replayed(quorum_run)


def test_quorum_drops_the_slow_ranks_late_gradients_and_takes_current_ones_only(quorum_run):
    steps = record(quorum_run)
    assert quorum_run[3]["dropped"] >= 1  # its gradients came after the others' steps closed
    assert all(s == 0 for step in steps for s in step["staleness"])
    # Before the fast ranks finished, every step closed with at least min_ranks gradients.
    fast_steps = [s for s in steps if s["step"] <= 10]
    assert all(len(s["ranks"]) >= 3 for s in fast_steps)
    assert all(c["step"] is None or c["staleness"] == 0
               for r in quorum_run.values() for c in r["contributions"])


def test_quorums_adaptive_timeout_drops_a_straggler_and_replicas_equal_the_replay():
    # The default timeout: twice the recent spread from a step's first gradient to its 3rd.
    # Rank 3 is 0.5 s late every iteration, far past the others' spread: its gradients are
    # dropped and the others' steps close without waiting for it.
    reports = asyncio.run(run_modes("quorum", "--min-ranks", "3", "--timeout", "adaptive",
                                    "--delays", "0,0,0,0.5", "--steps", "8"))
    assert_identical_and_replayed(reports)
    assert reports[3]["dropped"] >= 1
    # Before the fast ranks finished (8 steps), every step closed with at least min_ranks.
    fast_steps = [s for s in record(reports) if s["step"] <= 8]
    assert all(len(s["ranks"]) >= 3 for s in fast_steps)
    assert any(len(s["ranks"]) == 3 for s in fast_steps)


def test_data_parallel_with_a_process_group_in_quorum_equals_the_replay():
    # Each process splits its batch over 2 CPU replicas and contributes their summed gradient;
    # rank 3 is slow, as in quorum_run. Replicas sum in another order than one process: the
    # replay agrees to float32 rounding.
    reports = asyncio.run(run_modes("quorum", "--min-ranks", "3", "--timeout", "0.02",
                                    "--delays", "0,0,0,0.3", "--steps", "6",
                                    "--data-parallel", "2"))
    assert_identical_and_replayed(reports, rtol=1e-5, atol=1e-6)
    assert any(len(step["ranks"]) < WORLD for step in record(reports))  # quorum closed steps


def test_bounded_staleness_stays_within_its_bound_and_replicas_agree():
    reports = asyncio.run(run_modes("bounded", "--max-staleness", "2",
                                    "--delays", "0.01,0.03,0.02,0.2", "--steps", "10"))
    assert_identical_and_replayed(reports)
    assert_default_scaling(record(reports))
    every = [s for step in record(reports) for s in step["staleness"]]
    assert max(every) <= 2
    assert max(every) >= 1  # the slow rank's gradients were stale: the bound was exercised


def stale_share(steps: list[dict]) -> float:
    """The share of the record's gradients that were stale when they joined their step."""
    every = [s for step in steps for s in step["staleness"]]
    return sum(s > 0 for s in every) / len(every)


@pytest.mark.parametrize("mode", ["async", "bounded"])
def test_without_a_straggler_the_default_steps_hold_every_ranks_fresh_gradient(mode):
    # Equal ranks: the default (adaptive timeout) waits the ranks' own spread, so steps hold
    # every rank's gradient on current parameters, as Synchronous's; with timeout=0 a rank's
    # next gradient closes its previous step, and all but each step's last arrival come one
    # step stale (what left the stale modes behind Synchronous without a straggler).
    delays = ("--delays", "0.02,0.02,0.02,0.02", "--steps", "10")
    waited = asyncio.run(run_modes(mode, *delays))
    assert_identical_and_replayed(waited)
    pushed = asyncio.run(run_modes(mode, "--timeout", "0", *delays))
    assert_identical_and_replayed(pushed)
    fresh, stale = stale_share(record(waited)), stale_share(record(pushed))
    assert fresh <= 0.3 < 0.5 <= stale, (fresh, stale)
    full = [s for s in record(waited) if len(s["ranks"]) == WORLD]
    assert len(full) >= len(record(waited)) // 2


def test_asynchronous_weighted_contributions_equal_the_weighted_replay():
    # Rank 3 far later than the others' spread: the default wait closes steps without it.
    reports = asyncio.run(run_modes("async", "--delays", "0,0.01,0.02,0.15",
                                    "--weights", "1,2,3,0.5", "--steps", "8"))
    assert_identical_and_replayed(reports)
    weights = {r: w for s in record(reports)
               for r, w in zip(s["ranks"], s["weights"], strict=True)}
    assert weights == {0: 1.0, 1: 2.0, 2: 3.0, 3: 0.5}
    assert sum(len(s["ranks"]) for s in record(reports)) == WORLD * 8  # none dropped
    assert_default_scaling(record(reports))


def test_asynchronous_plain_scaling_applies_the_weighted_mean_as_it_is():
    # scaling="plain" restores the rule before step scaling: every factor a weight's share.
    reports = asyncio.run(run_modes("async", "--delays", "0,0.01,0.02,0.15", "--scaling",
                                    "plain", "--steps", "6"))
    assert_identical_and_replayed(reports)
    steps = record(reports)
    assert any(len(s["ranks"]) < WORLD for s in steps)
    for step in steps:
        assert step["factors"] == [float(np.float32(1 / len(step["ranks"])))] * len(
            step["ranks"])


def test_buffers_travel_with_the_steps_and_stay_identical():
    # BatchNorm's running statistics (float) and batch count (integer): every step's aggregate
    # carries their weighted mean, which every rank writes as it applies the step.
    reports = asyncio.run(run_modes("async", "--delays", "0,0.01,0.02,0.05", "--batchnorm",
                                    "--weights", "1,2,3,0.5", "--steps", "8"))
    assert_identical_and_replayed(reports, batchnorm=True)
    assert sum(len(s["ranks"]) for s in record(reports)) == WORLD * 8  # none dropped
    params = reports[0]["params"]
    # An integer again (rounded). Not a rank's own count of forward passes: each step's count is
    # the weighted mean of its contributions' counts, and a stale contribution's count is its
    # base's plus one, so the count can end below 8 (CI saw 7; the replay above, which rounds
    # the same way, is what pins its value). A bound that holds for any timing: the last step
    # holds each of its ranks' last forward pass, whose count is its base step's count (at
    # least 1) plus one, or 8 if the rank applied no step in all its 8 iterations; so >= 2.
    [batches] = params["1.num_batches_tracked"]
    assert isinstance(batches, int) and batches >= 2
    assert any(abs(v) > 1e-3 for v in params["1.running_mean"])  # the statistics moved


def test_a_learning_rate_schedule_stepped_per_rank_keeps_the_replicas_identical():
    # The LR falls every iteration and the ranks apply a step at different iterations of their
    # own: each step carries its contributions' mean LR and momentum, and every rank applies it
    # with those (without: each rank its own LR, and the replicas part).
    reports = asyncio.run(run_modes("async", "--delays", "0,0.01,0.03,0.06", "--schedule",
                                    "--steps", "8"))
    assert_identical_and_replayed(reports)
    lrs = [step["hyper"][0] for step in record(reports)]
    assert lrs[0] == pytest.approx(script.LR) and lrs[-1] < 0.5 * script.LR
    assert len(set(lrs)) > 3  # the schedule moved it step by step


def test_synchronous_weighted_steps_are_the_weighted_mean_of_every_rank():
    # The hub adds the ranks' sums in arrival order: equal to the replay up to rounding.
    reports = asyncio.run(run_modes("sync", "--weights", "1,2,3,0.5", "--steps", "5"))
    assert_identical_and_replayed(reports, rtol=1e-5, atol=1e-6)
    unweighted = script.params_of(script.replay(
        {r: reports[r]["contributions"] for r in reports},
        [{**s, "weights": [1.0] * WORLD} for s in record(reports)]))
    assert any(not np.allclose(reports[0]["params"][k], v, rtol=1e-4)
               for k, v in unweighted.items())  # the weights made a difference


@pytest.mark.parametrize("mode,how", [(m, h) for m in ("quorum", "bounded", "async")
                                      for h in ("kill", "stall")])
def test_a_rank_that_dies_or_stalls_holds_nobody(mode, how):
    reports = asyncio.run(run_modes(mode, "--min-ranks", "4", "--max-staleness", "1",
                                    "--delays", "0.02,0.02,0.02,0.02", "--steps", "8",
                                    "--stop-rank", "3", "--stop-at", "3", "--stop-how", how,
                                    stopped=3))
    assert [r for r in reports if "params" in reports[r]] == [0, 1, 2]  # no survivor raised
    assert_identical_and_replayed(reports)
    steps = record(reports)
    # The steps closed without it: it is in at most its 3 iterations before it stopped (not
    # "absent from the last step": a rank that started late can have its 3 gradients arrive
    # after the others' 8, and close the last step itself).
    assert sum(3 in step["ranks"] for step in steps) <= 3


def test_a_job_grows_by_a_rank_while_it_trains_and_ends_identical(tmp_path):
    # Four ranks train in Quorum; a fifth process joins past the world size (GRADSTAR_ELASTIC,
    # no rank, GRADSTAR_MAX_WORLD_SIZE 5), starts from the hub's snapshot and contributes;
    # no process restarts, and at the end all five agree bit for bit with the hub's record.
    reports = asyncio.run(run_modes("quorum", "--min-ranks", "3", "--timeout", "0.0",
                                    "--delays", "0.3,0.3,0.3,0.3,0.3", "--steps", "30",
                                    "--await-replacement", str(tmp_path / "joined"),
                                    grow=True, timeout=150))
    assert sorted(reports) == [0, 1, 2, 3, 4]
    assert reports[4]["replacement"] and not reports[0]["replacement"]
    assert_identical_and_replayed(reports)
    grown = [c for c in reports[4]["contributions"] if c["step"] is not None]
    assert grown, "the new rank never contributed"
    assert grown[0]["base"] > 0  # it computed on the hub's state, not from the start
    steps = record({r: rep for r, rep in reports.items() if "params" in rep})
    assert any(4 in step["ranks"] for step in steps)


def test_a_restarted_rank_joins_from_the_hub_and_ends_identical(tmp_path):
    # Rank 3 dies at its 4th iteration; a new process takes its place (GRADSTAR_ELASTIC, as
    # the agent restarts it), starts from the hub's snapshot while the others train on, and
    # contributes again; at the end all four agree bit for bit.
    reports = asyncio.run(run_modes("quorum", "--min-ranks", "3", "--timeout", "0.0",
                                    "--delays", "0.3,0.3,0.3,0.3", "--steps", "30",
                                    "--await-replacement", str(tmp_path / "joined"),
                                    "--stop-rank", "3", "--stop-at", "3", "--stop-how", "kill",
                                    stopped=3, restart=True, timeout=150))
    assert reports[3]["replacement"] and not reports[0]["replacement"]
    assert_identical_and_replayed(reports)
    rejoined = [c for c in reports[3]["contributions"][3:] if c["step"] is not None]
    assert rejoined, "the restarted rank never contributed"
    assert rejoined[0]["base"] > 3  # it computed on the hub's state, not from the start
