"""``gradstar demo --report FILE.json --plot FILE.png``: the report holds what the demo printed,
as data, and the plot is a PNG that decodes. The demo run itself is test_demo.py's (one small
run checks both its printed report and these files: see :func:`check_artefacts`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib.image
import numpy as np

from gradstar.worker.demo.report import PLOT_NEEDS, SCHEMA, write_plot, write_report

from .conftest import clean_env, run_gradstar

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: The plot's size in pixels (figsize 10 x 4.2 inches at 100 dpi).
PLOT_SHAPE = (420, 1000)


def number(text: str) -> float:
    return float(text.replace(",", ""))


def check_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[:2] == PLOT_SHAPE
    # Drawn on, not blank: axes, text and lines in several colours.
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 20


def check_artefacts(out: str, report_path: Path, plot_path: Path, *, workers: int, epochs: int,
                    samples: int, mode: str = "ddp") -> None:
    """The report and plot of a demo run that printed ``out`` and passed."""
    assert re.search(rf"^  report +{re.escape(str(report_path))}$", out, re.M)
    assert re.search(rf"^  plot +{re.escape(str(plot_path))}$", out, re.M)
    check_png(plot_path)
    report = json.loads(report_path.read_text())
    assert (report["schema"], report["passed"], report["exit_code"]) == (SCHEMA, True, 0)
    assert {k: report["settings"][k] for k in ("workers", "mode", "epochs", "samples")} == {
        "workers": workers, "mode": mode, "epochs": epochs, "samples": samples}
    assert list(report["modes"]) == [mode]
    run = report["modes"][mode]
    assert run["job"] == f"demo-{mode}" and run["match"] is True

    # Every epoch as its progress bar printed it.
    bars = re.findall(r"^epoch (\d+)/\d+ \|.*\|.*  loss ([\d.]+)  test acc ([\d.]+)%  ([\d.]+) s$",
                      out, re.M)
    assert [e["epoch"] for e in run["epochs"]] == list(range(1, epochs + 1))
    assert [(str(e["epoch"]), f"{e['loss']:.4f}", f"{e['test_accuracy']:.1%}"[:-1],
             f"{e['seconds']:.1f}") for e in run["epochs"]] == bars

    result = run["result"]
    assert (f"result       test accuracy {result['test_accuracy']:.1%}, test loss "
            f"{result['test_loss']:.4f}; train accuracy {result['train_accuracy']:.1%}") in out
    speed = run["throughput"]
    printed = re.search(r"throughput +([\d,]+) samples/s, ([\d.]+) steps/s \(([\d,]+) steps of "
                        r"([\d,]+) samples", out)
    assert printed[1] == f"{speed['samples_per_second']:,.0f}"
    assert int(number(printed[3])) == speed["steps"] and speed["ranks"] == workers
    assert speed["samples"] == speed["steps"] * speed["samples_per_step"]
    assert speed["samples_per_second"] == speed["samples"] / speed["seconds"]

    traffic = run["traffic"]
    assert traffic["bytes_total"] == traffic["bytes_in"] + traffic["bytes_out"] > 0
    assert (f"{traffic['bytes_total'] / 1e6:,.1f} MB through the hub: "
            f"{traffic['bytes_in'] / 1e6:,.1f} MB in") in out
    collectives = traffic["collectives"]
    assert all(c["failed"] == 0 for c in collectives.values()), collectives
    for name, c in collectives.items():  # as the Admin counters printed say
        assert f"{c['completed']:,} {name}" in out
    check_mode_traffic(mode, traffic, speed, report["settings"])

    replay = run["single_process"]["replay"]
    assert replay["match"] and replay["max_abs_difference"] <= replay["tolerance"] == 1e-4
    assert f"max |difference| {replay['max_abs_difference']:.1e} (after step " in out
    scratch = run["single_process"]["from_scratch"]
    assert f"test accuracy {scratch['test_accuracy']:.1%}, predictions agree on " in out
    assert [e["epoch"] for e in scratch["epochs"]] == list(range(1, epochs + 1))
    # The last epoch's evaluation is the finished model's.
    assert scratch["epochs"][-1]["test_accuracy"] == scratch["test_accuracy"]
    assert 0.0 <= scratch["prediction_agreement"] <= 1.0


def check_mode_traffic(mode: str, traffic: dict, speed: dict, settings: dict) -> None:
    """The traffic the mode's training loop must have caused, at the least."""
    steps, done = speed["steps"], {n: c["completed"] for n, c in traffic["collectives"].items()}
    peer = traffic["peer"]
    assert peer["bytes_sent"] == peer["bytes_received"]  # every message sent was received
    assert peer["bytes_per_step"] == peer["bytes_sent"] / steps
    if mode == "ddp":  # the gradients, every step
        assert done["all_reduce"] >= steps
    elif mode == "localsgd":  # the parameters, every sync_every steps
        assert steps > done["all_reduce"] >= steps // settings["sync_every"]
    elif mode == "fsdp":  # each unit's parameters gathered, its gradients reduce-scattered
        assert done["all_gather"] >= steps and done["reduce_scatter"] >= steps
    if mode == "pipeline":
        # Stage to stage, not through the hub: each step's activations (batch x hidden float32)
        # forward and their gradients back, besides the evaluations' activations.
        assert peer["bytes_sent"] >= steps * speed["samples_per_step"] * settings["hidden"] * 8
        assert traffic["bytes_total"] < peer["bytes_sent"] / 1000
    else:
        assert peer["bytes_sent"] == 0


def check_streaming_artefacts(out: str, report_path: Path, plot_path: Path, *, workers: int,
                              epochs: int, samples: int) -> None:
    """The report and plot of a ``--mode streaming-diloco`` run that printed ``out`` and
    passed: replicas, not ranks, and the bytes of its rounds beside DDP's."""
    mode = "streaming-diloco"
    assert re.search(rf"^  report +{re.escape(str(report_path))}$", out, re.M)
    assert re.search(rf"^  plot +{re.escape(str(plot_path))}$", out, re.M)
    check_png(plot_path)
    report = json.loads(report_path.read_text())
    assert (report["schema"], report["passed"], report["exit_code"]) == (SCHEMA, True, 0)
    assert {k: report["settings"][k] for k in ("workers", "mode", "epochs", "samples")} == {
        "workers": workers, "mode": mode, "epochs": epochs, "samples": samples}
    run = report["modes"][mode]
    assert run["job"] == f"demo-{mode}" and run["match"] is True
    assert run["replicas"]["identical_global_model"] is True
    assert [e["epoch"] for e in run["epochs"]] == list(range(1, epochs + 1))
    assert all(0 <= e["test_accuracy"] <= 1 and e["loss"] > 0 for e in run["epochs"])

    result = run["result"]
    assert f"test accuracy {result['test_accuracy']:.3f} (loss {result['test_loss']:.3f})" in out
    speed = run["throughput"]
    assert speed["replicas"] == workers
    assert speed["samples"] == speed["steps"] * speed["samples_per_step"]
    assert speed["samples_per_step"] == workers * report["settings"]["batch_size"]

    traffic = run["traffic"]
    sent, received = traffic["bytes_sent"], traffic["bytes_received"]
    assert traffic["bytes_total"] == sent + received and sent > 0 and received > 0
    per_step = traffic["bytes_total"] / speed["steps"] / workers
    assert traffic["bytes_per_step_and_replica"] == per_step
    # Each replica sends every fragment at each of its rounds: the whole model per round.
    rounds = traffic["rounds"]
    assert sorted(rounds) == [str(f) for f in range(traffic["fragments"])]
    assert all(n >= 1 for n in rounds.values())
    assert sent >= min(rounds.values()) * workers * 4 * traffic["parameters"]
    # DDP: every gradient to the hub and back, every step, on every replica.
    assert traffic["ddp_bytes"] == 2 * 4 * traffic["parameters"] * speed["steps"] * workers
    assert traffic["ddp_ratio"] == traffic["ddp_bytes"] / traffic["bytes_total"] > 1
    assert (f"bytes through the hub: {traffic['bytes_total']:,} ({sent:,} sent, {received:,} "
            f"received; DDP would move {traffic['ddp_bytes']:,}") in out
    assert ", ".join(f"fragment {f}: {n}" for f, n in rounds.items()) in out


def test_a_plot_per_mode_with_its_single_process_reference(tmp_path):
    epochs = [{"epoch": e, "loss": 1.0 / e, "test_accuracy": 0.3 + 0.1 * e, "seconds": 0.5}
              for e in (1, 2, 3)]
    report = {"passed": False, "settings": {"workers": 3}, "modes": {
        "ddp": {"epochs": epochs,
                "single_process": {"from_scratch": {"epochs": epochs}}},
        "localsgd": {"epochs": epochs[:1]}}}  # a run that failed after one epoch
    write_plot(tmp_path / "a" / "plot.png", report)
    check_png(tmp_path / "a" / "plot.png")
    write_report(tmp_path / "b" / "report.json", report)
    assert json.loads((tmp_path / "b" / "report.json").read_text()) == report


async def test_plot_without_matplotlib_names_the_extra_to_install(tmp_path):
    # A matplotlib that cannot be imported, ahead of the real one on the path.
    fake = tmp_path / "site" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    code, out, err = await run_gradstar(
        "demo", "--workers", "2", "--plot", str(tmp_path / "p.png"), "--report",
        str(tmp_path / "r.json"), timeout=60, env=clean_env(PYTHONPATH=str(tmp_path / "site")))
    assert (code, out, err) == (2, "", f"gradstar demo: {PLOT_NEEDS}\n")
    assert "pip install 'gradstar[plot]'" in PLOT_NEEDS
    assert not (tmp_path / "p.png").exists() and not (tmp_path / "r.json").exists()
