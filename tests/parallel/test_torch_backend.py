"""torch.distributed over backend "gradstar", proved against the same script over "gloo".

``torch_backend_script.py`` is an ordinary torch.distributed program; only ``backend=`` and
``init_method=`` differ between the runs. For 2 and 4 ranks it runs once per backend (all
scenarios in one process group, both backends at the same time) and every test below compares
one scenario's reports: torch's DDP, DDP with torch's bf16 compression hook, FSDP2
``fully_shard``, the collectives, new_group subgroups and send/recv. gradstar's run also plays
the error scenario, and a separate test ends 20 pairs of rank processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import numpy as np
import pytest

from gradstar.config import CoordinatorSettings
from gradstar.coordinator import Coordinator
from tests.integration.conftest import start_coordinator  # noqa: F401  (fixture)

from . import torch_backend_script as script
from .conftest import finish, kill_all, rank_lines

WORLDS = (2, 4)
COMPARED = ["ddp", "ddp_bf16_hook", "fsdp2", "collectives", "p2p"]
# float32 training of 5 steps: both backends sum the ranks' gradients in float32, but not
# necessarily in the same order, so parameters agree to rounding.
RTOL, ATOL = 1e-5, 1e-6
EXIT_RUNS = 20
# Each process below is bounded by its own deadline; this is the backstop for the module's
# first test, whose setup starts 12 rank processes on a shared two-core machine.
pytestmark = pytest.mark.timeout(400)


async def run_ranks(world: int, argv_of, timeout: float) -> list[dict[str, dict]]:
    """``world`` processes of the script (argv by rank); {scenario: report} for each rank.

    Raises:
        AssertionError: a rank exited non-zero or hung (its output tail is in the message).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSTAR_")}
    procs = []
    try:
        for rank in range(world):
            procs.append(await asyncio.create_subprocess_exec(
                sys.executable, str(script.SCRIPT), *argv_of(rank), env=env,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE))
        results = await asyncio.gather(*(finish(p, timeout) for p in procs),
                                       return_exceptions=True)
    finally:
        await kill_all(procs)
    reports = []
    for rank, result in enumerate(results):
        lines = rank_lines(rank, result)
        assert all(line["rank"] == rank and "fatal" not in line for line in lines), lines
        reports.append({line["scenario"]: line for line in lines})
    return reports


async def both_backends(world: int, rendezvous_file, job: str, gradstar_scenarios,
                        gloo_scenarios, timeout: float = 150) -> tuple[list, list]:
    """``world`` ranks of the script over gradstar (a fresh in-process hub, job ``job``) and
    over gloo (file rendezvous), both at once; (gradstar reports, gloo reports)."""
    hub = Coordinator(CoordinatorSettings(host="127.0.0.1", port=0))
    await hub.start()
    try:
        def argv(backend: str, init_method: str, *scenarios: str):
            return lambda rank: ["ranks", "--backend", backend, "--init-method", init_method,
                                 "--rank", str(rank), "--world-size", str(world), *scenarios]

        return await asyncio.gather(
            run_ranks(world, argv("gradstar", f"gradstar://{hub.address}?job={job}"
                                              "&timeout=60", *gradstar_scenarios), timeout),
            run_ranks(world, argv("gloo", f"file://{rendezvous_file}", *gloo_scenarios),
                      timeout))
    finally:
        await hub.stop(grace=0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, int], list[dict[str, dict]]]:
    """{(backend, world): [rank 0's {scenario: report}, ...]} for both backends and worlds."""
    folder = tmp_path_factory.mktemp("gloo-rendezvous")

    async def everything():
        return await asyncio.gather(*(
            both_backends(w, folder / f"world{w}", f"torch{w}", (*COMPARED, "errors"), COMPARED)
            for w in WORLDS))

    out = {}
    for world, (gradstar_reports, gloo_reports) in zip(WORLDS, asyncio.run(everything()),
                                                       strict=True):
        out["gradstar", world], out["gloo", world] = gradstar_reports, gloo_reports
    return out


def assert_params_close(got: dict, want: dict, rtol=RTOL, atol=ATOL, what=""):
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol,
                                   err_msg=f"{what} {name}")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("scenario", ["ddp", "ddp_bf16_hook", "fsdp2"])
def test_training_matches_gloo(runs, scenario, world):
    # DDP: ranks start from different inits, so matching also proves DDP's broadcast went over
    # gradstar. bf16 hook: gloo and the hub both add the bf16 values in float32 and round once
    # per reduction step; on 4 ranks gloo rounds between pairwise steps, so allow bf16 rounding
    # of a 0.1-lr step (a bf16 ulp is 2**-8 relative).
    rtol, atol = (RTOL, ATOL) if scenario != "ddp_bf16_hook" or world == 2 else (1e-2, 2e-3)
    for rank in range(world):
        gradstar_report = runs["gradstar", world][rank][scenario]
        gloo_report = runs["gloo", world][rank][scenario]
        assert_params_close(gradstar_report["params"], gloo_report["params"], rtol, atol,
                            f"{scenario}, rank {rank} of {world}:")
        # Every replica (and every FSDP2 rank's gathered view) is the same model.
        assert gradstar_report["params"] == runs["gradstar", world][0][scenario]["params"]
        if scenario == "fsdp2":
            # ... and FSDP2 really sharded it: each rank holds the same shards as under gloo.
            assert gradstar_report["local_shapes"] == gloo_report["local_shapes"]
            assert gradstar_report["local_shapes"]["2.weight"] == [script.HIDDEN // world,
                                                                   script.HIDDEN]


@pytest.mark.parametrize("world", WORLDS)
def test_collectives_and_subgroups_match_gloo(runs, world):
    for rank in range(world):
        got = dict(runs["gradstar", world][rank]["collectives"])
        want = dict(runs["gloo", world][rank]["collectives"])
        # Written in place into a non-contiguous view: gradstar gets it right, gloo 2.13 writes
        # its result over the view's storage as if it were contiguous, so check by hand.
        assert got.pop("all_reduce_view") == [float(world - 1)] * 2
        want.pop("all_reduce_view")
        assert got == want, {k: (got.get(k), want.get(k)) for k in want if got.get(k) != want[k]}
    reports = [runs["gradstar", world][r]["collectives"] for r in range(world)]
    assert reports[0]["all_reduce_AVG"] == [(world + 1) / 2 + i for i in range(4)]
    assert reports[1]["new_group_pair"]["rank"] == 1
    assert reports[1]["new_group_odd"]["size"] == world // 2
    assert all(r["new_group_pair"] is None for r in reports[2:])


@pytest.mark.parametrize("world", WORLDS)
def test_send_recv_match_gloo(runs, world):
    for rank in range(world):
        assert runs["gradstar", world][rank]["p2p"] == runs["gloo", world][rank]["p2p"]
    assert runs["gradstar", world][1]["p2p"]["pair"] == [0, 1, 2, 3]


@pytest.mark.parametrize("world", WORLDS)
def test_a_failed_collective_is_a_python_exception_and_the_next_one_works(runs, world):
    for rank in range(world):
        report = runs["gradstar", world][rank]["errors"]
        name, message = report["mismatch"]
        assert name == "CollectiveMismatchError"
        assert message.startswith(f"[Rank {rank}] ranks disagree on collective seq ")
        assert "(shape differs)" in message
        # The async form: the future fails (torch wraps the callback's error) and so does wait().
        assert report["future_error"] == "RuntimeError"
        assert report["wait_error"] == "CollectiveMismatchError"
        assert report["premul_sum"] == ["ConfigurationError", (
            "ReduceOp.PREMUL_SUM is not supported by the gradstar backend: torch does not expose "
            "its scale factor to Python backends; multiply the tensor by the factor and use "
            "ReduceOp.SUM")]
        name, message = report["meta"]
        assert name == "ConfigurationError" and "this tensor is on meta" in message, message
        # DDP whose rank 0 compresses to bf16: backward() raises on every rank, no SIGSEGV.
        name, message = report["ddp_error"]
        assert name == "RuntimeError"
        assert "CollectiveMismatchError" in message and "(dtype differs)" in message
        assert report["after"] == [sum(range(world))] * 2


async def test_twenty_runs_end_with_a_clean_process_exit(start_coordinator,  # noqa: F811
                                                         tmp_path):
    coordinator = await start_coordinator()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script.SCRIPT), "exits", "--coordinator", coordinator.address,
        "--scratch", str(tmp_path), "--runs", str(EXIT_RUNS), "--timeout", "40",
        env={k: v for k, v in os.environ.items() if not k.startswith("GRADSTAR_")},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    code, out, err = await finish(proc, 360)
    assert code == 0, err[-3000:]
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    ends = {line["run"]: line["ends"] for line in lines if "ends" in line}
    reports = {(line["run"], line["rank"]): line for line in lines if "rank" in line}
    assert sorted(ends) == list(range(EXIT_RUNS))
    failed = {run: e for run, e in ends.items() if e != [["exit", 0], ["exit", 0]]}
    assert not failed, f"runs that did not exit cleanly: {failed}\n{err[-3000:]}"
    for run in range(EXIT_RUNS):
        variant = run % 4
        for rank in (0, 1):
            report = reports[run, rank]
            assert "fatal" not in report, report
            assert report["sum"] == [3.0, 3.0]
            assert report["mismatch"] == "CollectiveMismatchError"
            assert report["ddp"] == ("RuntimeError" if variant == 2 else "ok")
            if variant != 3:
                assert report["after"] == [3.0, 3.0]
            if variant == 0:
                assert report["gloo_subgroup"] == [3.0, 3.0]
        if variant == 3:
            # Rank 1's exit hook closed its group: it finished (a RankLostError that says so).
            name, message = reports[run, 0]["barrier"]
            assert name == "RankFinishedError"
            assert message.startswith(f"[Rank 0] rank 1 of job 'exit-{run}' finished")
