"""``gradstar demo`` (the main job) runs to its report, small enough for the test suite."""

from __future__ import annotations

import re

import pytest

from gradstar.worker.demo.command import mode_unavailable

from .conftest import run_gradstar
from .test_demo_artefacts import check_artefacts, check_streaming_artefacts

SMALL = ("--workers", "2", "--epochs", "2", "--samples", "3000")


async def test_demo_trains_and_reports_a_match_with_one_process(tmp_path):
    # The default mode, small: 2 epochs of 18 steps, so two stretches are replayed; with the
    # JSON report and the plot (checked against what it printed).
    mode = "ddp"
    json_file, png_file = tmp_path / "out" / "report.json", tmp_path / "out" / "demo.png"
    code, out, err = await run_gradstar("demo", *SMALL, "--report", str(json_file), "--plot",
                                        str(png_file), timeout=150)

    assert code == 0, out[-3000:] + err[-3000:]
    assert f"gradstar demo: {mode} on 2 worker processes, coordinator 127.0.0.1:" in out
    # One finished progress bar per epoch (the output is not a terminal).
    assert len(re.findall(r"^epoch [12]/2 \|[#█]+\| (\d+)/\1  loss [\d.]+  test acc [\d.]+%", out,
                          re.M)) == 2
    report = out[out.index("\nreport\n"):]
    assert re.search(r"result +test accuracy [\d.]+%, test loss [\d.]+; train accuracy", report)
    assert re.search(r"throughput +[\d,]+ samples/s", report)
    traffic = re.search(r"traffic +([\d.,]+) MB through the hub: ([\d.,]+) MB in, ([\d.,]+) MB out"
                        rf".*Admin counters of job 'demo-{mode}': .*all_reduce", report)
    assert traffic and float(traffic[2].replace(",", "")) > 0
    assert "ranks        all 2 hold identical final parameters" in report
    replay = re.search(r"max \|difference\| ([\d.e+-]+) .*-> MATCH", report)
    assert replay and float(replay[1]) <= 1e-4
    assert re.search(r"predictions agree on [\d.]+% of test points", report)
    assert "demo passed" in out
    check_artefacts(out, json_file, png_file, workers=2, epochs=2, samples=3000)


@pytest.mark.parametrize("mode", ["localsgd", "fsdp", "pipeline"])
async def test_the_other_modes_match_one_process_and_report_their_traffic(mode, tmp_path):
    # fsdp and pipeline need gradstar.FSDP / gradstar.Pipeline; a build without them names what
    # is missing. Each writes its report and plot, with its own traffic (test_demo_artefacts).
    problem = mode_unavailable(mode)
    json_file, png_file = tmp_path / "report.json", tmp_path / "demo.png"
    code, out, err = await run_gradstar("demo", "--mode", mode, "--workers", "2", "--epochs",
                                        "1", "--samples", "900", "--report", str(json_file),
                                        "--plot", str(png_file), timeout=120)
    if problem is not None:
        assert code == 2
        assert f"gradstar demo: mode {mode!r} needs" in err
        return
    assert code == 0, out[-3000:] + err[-3000:]
    assert re.search(r"max \|difference\| [\d.e+-]+ .*-> MATCH", out)
    assert "demo passed" in out
    check_artefacts(out, json_file, png_file, workers=2, epochs=1, samples=900, mode=mode)


async def test_a_pipeline_needs_a_layer_per_stage():
    code, _, err = await run_gradstar("demo", "--mode", "pipeline", "--workers", "6", timeout=60)
    assert code == 2
    assert "at most 5 workers, not 6" in err


async def test_streaming_diloco_mode_trains_replicas_through_fault_tolerant_rounds(tmp_path):
    json_file, png_file = tmp_path / "report.json", tmp_path / "demo.png"
    code, out, err = await run_gradstar("demo", "--mode", "streaming-diloco", "--workers", "2",
                                        "--epochs", "2", "--samples", "3000", "--report",
                                        str(json_file), "--plot", str(png_file), timeout=120)
    assert code == 0, out[-3000:] + err[-3000:]
    assert "gradstar demo: streaming-diloco on 2 replica processes" in out
    accuracy = re.search(r"test accuracy ([\d.]+) ", out)
    assert accuracy and float(accuracy[1]) > 0.4, out  # 3 classes: chance is 0.33
    assert re.search(r"rounds: fragment 0: [1-9]\d*, fragment 1: [1-9]", out), out
    assert "replicas: all 2 hold the same global model" in out
    assert "demo passed" in out
    check_streaming_artefacts(out, json_file, png_file, workers=2, epochs=2, samples=3000)
