"""Every script in examples/, run the way README.md and examples/README.md say: a real
``gradstar launch`` process from the repository root, real rank processes, the embedded
coordinator on 127.0.0.1 and a free port (or a given one), a deadline on every run.

Each test checks that every rank exited 0, that nothing printed a traceback or a warning, and
the script's result line(s): the numbers a collective must give, a loss that went down, ranks
that hold the same parameters.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradstar.coordinator import EmbeddedCoordinator
from tests.runtime.conftest import clean_env

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
LAUNCH_TIMEOUT = 240  # seconds for one launch; ~10-30 s on 2 idle cores


def run(command: list[str], timeout: float) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``command`` run from the repository root.

    A command that outlives ``timeout`` gets SIGTERM (``gradstar launch`` and torchrun then stop
    their ranks), SIGKILL 15 s later, and fails the test.
    """
    proc = subprocess.Popen(command, cwd=ROOT, env=clean_env(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise AssertionError(f"`{' '.join(command)}` outlived {timeout} s:\n{out[-3000:]}\n"
                             f"{err[-3000:]}") from None
    return proc.returncode, out, err


def check_clean(code: int, out: str, err: str) -> None:
    shown = f"exit code {code}\nstdout:\n{out[-4000:]}\nstderr:\n{err[-6000:]}"
    assert code == 0, shown
    assert "Traceback" not in out + err, shown
    assert "Warning" not in out + err, shown  # e.g. a deprecated torch API in an example


def launch(nproc: int, *args: str, timeout: float = LAUNCH_TIMEOUT) -> str:
    """``gradstar launch --nproc N ARGS``'s stdout, once it exited 0 with every rank exiting 0
    and no traceback or warning in its output."""
    code, out, err = run([sys.executable, "-m", "gradstar", "launch", "--nproc", str(nproc),
                          *args], timeout)
    check_clean(code, out, err)
    for rank in range(nproc):
        assert re.search(rf"rank {rank} \(pid \d+\) exited with code 0", err), err
    assert f"all {nproc} ranks succeeded" in err, err
    return out


def results(out: str, name: str, prefixed: bool = True) -> dict[int, str]:
    """{rank: the rest of the line} of the lines ``[rank R] NAME: rank R of N: ...``; without
    ``gradstar launch``'s ``[rank R]`` prefix unless ``prefixed``."""
    found = {}
    for prefix, rank, rest in re.findall(
            rf"^(?:\[rank (\d+)\] )?{re.escape(name)}: rank (\d+) of \d+: (.*)$", out, re.M):
        assert prefix == (rank if prefixed else ""), out  # a rank prints its own rank
        found[int(rank)] = rest
    return found


def losses(line: str) -> tuple[float, float]:
    before, after = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", line).groups()
    return float(before), float(after)


def digest(line: str) -> str:
    return re.search(r"parameters sha256 ([0-9a-f]{16})", line).group(1)


def check_trained_identically(found: dict[int, str], nproc: int, *, by: float) -> None:
    """Every rank reported; each loss fell ``by`` times at least; one parameter digest."""
    assert sorted(found) == list(range(nproc)), found
    for line in found.values():
        before, after = losses(line)
        assert after * by < before, line
    assert len({digest(line) for line in found.values()}) == 1, found


def test_process_group():
    found = results(launch(4, "examples/process_group.py"), "process_group")

    assert sorted(found) == [0, 1, 2, 3], found
    for r, line in found.items():
        # reduce_scatter: rank r' sends [r', r'+1, ...]; the sum of row i is 0+1+2+3 + 4i.
        assert line == (f"all_reduce mean 1.5, all_gather [0, 1, 4, 9], broadcast 1234, "
                        f"reduce_scatter [{6.0 + 8 * r}, {10.0 + 8 * r}]"), line


def test_process_group_async():
    found = results(launch(4, "examples/process_group_async.py"), "process_group_async")

    assert found == {r: "reduce_scatter Tensor (2, 3) of 10, all_reduce max 3, all_gather "
                        "[0, 1, 2, 3]" for r in range(4)}


def test_ddp():
    found = results(launch(2, "examples/ddp.py"), "ddp")

    check_trained_identically(found, 2, by=10)


def test_data_parallel():
    found = results(launch(2, "examples/data_parallel.py"), "data_parallel")

    check_trained_identically(found, 2, by=10)
    replicas = max(torch.cuda.device_count(), 2)
    assert all(f"{replicas} replicas;" in line for line in found.values()), found


def test_fsdp():
    out = launch(2, "examples/fsdp.py")
    found = results(out, "fsdp")

    assert sorted(found) == [0, 1], found
    held = [int(re.search(r"holds (\d+) of (\d+) parameters", line).group(1))
            for line in found.values()]
    total = int(re.search(r"of (\d+) parameters", found[0]).group(1))
    assert all(h < total for h in held) and sum(held) >= total, found  # shards, padded
    assert len({losses(line) for line in found.values()}) == 1, found  # one model, sharded
    before, after = losses(found[0])
    assert after * 10 < before, found
    plain = re.search(r"^\[rank 0\] fsdp: full_state_dict loaded into the plain model: "
                      r"loss (\d+\.\d+)$", out, re.M)
    assert plain and float(plain.group(1)) == pytest.approx(after, abs=2e-4), out


def test_pipeline_with_4_stages_exits_cleanly():
    out = launch(4, "examples/pipeline.py")
    lines = dict(re.findall(r"^\[rank (\d)\] pipeline: stage \1 of 4: (.*)$", out, re.M))

    assert sorted(lines) == ["0", "1", "2", "3"], out
    before, after = losses(lines["3"])  # only the last stage computes the loss
    assert after * 5 < before, lines
    assert not any("loss" in lines[s] for s in "012"), lines
    # 1F1B: stage r holds at most stages - r micro-batches' activations.
    for stage in range(4):
        held = int(re.search(r"at most (\d+) micro-batches", lines[str(stage)]).group(1))
        assert held == 4 - stage, lines


@pytest.mark.parametrize("flags", [(), ("--diloco",)], ids=["local_sgd", "diloco"])
def test_local_sgd(flags):
    found = results(launch(2, "examples/local_sgd.py", *flags),
                    "diloco" if flags else "local_sgd")

    check_trained_identically(found, 2, by=5)
    assert all("after 6 rounds of 8 steps" in line for line in found.values()), found


def test_torch_backend():
    found = results(launch(2, "examples/torch_backend.py"), "torch_backend")

    check_trained_identically(found, 2, by=10)
    assert all("all_gather_single [0.0, 1.0]" in line for line in found.values()), found


def test_torch_backend_under_torchrun():
    # torchrun sets torch's env:// variables and no GRADSTAR_*: rank 0 starts a coordinator.
    code, out, err = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", "examples/torch_backend.py"], LAUNCH_TIMEOUT)

    check_clean(code, out, err)
    found = results(out, "torch_backend", prefixed=False)
    check_trained_identically(found, 2, by=10)


def epochs(out: str) -> list[tuple[int, float, float]]:
    """(epoch, loss, test accuracy %) of rank 0's epoch lines."""
    return [(int(e), float(loss), float(acc)) for e, loss, acc in re.findall(
        r"^\[rank 0\] train: epoch (\d+)/\d+: loss (\d+\.\d+), test accuracy (\d+\.\d)%$",
        out, re.M)]


def test_train_with_an_embedded_coordinator(tmp_path):
    saved = tmp_path / "model.pt"
    out = launch(4, "examples/train.py", "--epochs", "3", "--save", str(saved))

    report = epochs(out)
    assert [e for e, _, _ in report] == [1, 2, 3], out
    assert report[-1][1] < report[0][1] and report[-1][2] > 80, report
    assert "train: epoch" not in out.replace("[rank 0] train: epoch", ""), out  # rank 0 only
    state = torch.load(saved, weights_only=True)
    assert {k: tuple(v.shape) for k, v in state.items()} == {
        "0.weight": (64, 8), "0.bias": (64,), "2.weight": (3, 64), "2.bias": (3,)}


def test_train_joins_a_given_coordinator():
    with EmbeddedCoordinator() as hub:
        out = launch(2, "--coordinator", hub.address, "--job", "j", "examples/train.py",
                     "--epochs", "1")
        job = hub.coordinator.rendezvous.jobs["j"]

        assert job.world_size == 2 and job.generations_formed == 1
    assert [e for e, _, _ in epochs(out)] == [1], out


def test_every_example_is_tested_and_listed_in_both_readmes():
    scripts = sorted(path.name for path in EXAMPLES.glob("*.py"))
    mention = re.compile(r"(?<![\w/])examples/(\w+\.py)")  # not tests/examples/...
    for path in (Path(__file__), EXAMPLES / "README.md", ROOT / "README.md"):
        named = sorted(set(mention.findall(path.read_text(encoding="utf-8"))))

        assert named == scripts, path
    assert len(scripts) == 11, scripts  # the data_parallel.py of issue 35 made it 11


def test_sync_modes():
    found = results(launch(4, "examples/sync_modes.py"), "sync_modes")

    check_trained_identically(found, 4, by=10)
    applied = {re.search(r"(\d+) steps applied", line).group(1) for line in found.values()}
    assert len(applied) == 1, found  # every rank applied the same steps


def test_streaming_diloco():
    found = results(launch(3, "examples/streaming_diloco.py"), "streaming_diloco")

    assert sorted(found) == [0, 1, 2], found
    for line in found.values():
        before, after = losses(line)
        assert after * 5 < before, line
    digests = {line.rsplit("sha256 ", 1)[1] for line in found.values()}
    assert len(digests) == 1, found  # every replica ends with the same global model
    assert all("rounds [8, 8, 8]" in line for line in found.values()), found
