"""``gradstar demo --report FILE.json`` and ``--plot FILE.png``: what the demo prints, as data
and as a picture.

The report (:data:`SCHEMA`) holds, per mode the demo ran (one today: ``--mode``), the loss and
test accuracy of every epoch as the reporting rank saw them, the final result, throughput, the
mode's traffic and the comparison with single-process training: the replay of every stretch and
a run from scratch, whose per-epoch loss and accuracy are the reference line of the plot. The
traffic is the bytes through the hub (the Admin service's counters of the job) and, rank to
rank, over peer streams (a pipeline's activations and gradients). Streaming DiLoCo
(:mod:`.streaming`) trains replicas instead of ranks: its traffic is the bytes of its outer
rounds beside what DDP would have moved, its result the hub's global model, and it has no
single-process run. :func:`write_report` writes it;
:func:`write_plot` draws it with matplotlib's Agg renderer (no display, no pyplot state), which
comes with the ``plot`` extra: ``pip install 'gradstar[plot]'``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: Names the report's layout; a change that breaks readers bumps the number.
SCHEMA = "gradstar.demo.report/1"
#: Why --plot cannot work here, when matplotlib is missing.
PLOT_NEEDS = ("--plot needs matplotlib, which is not installed; install the plot extra: "
              "pip install 'gradstar[plot]' (or pip install matplotlib)")


def plot_unavailable() -> str | None:
    """Why :func:`write_plot` cannot run in this environment, or None if it can."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return PLOT_NEEDS
    return None


def report_data(options, seconds: float, exit_code: int, modes: dict,
                error: str | None = None) -> dict:
    """The whole report of a run with ``options`` (a :class:`.command.DemoOptions`) that took
    ``seconds`` and ended with ``exit_code``; ``modes`` maps the mode run to what it measured."""
    report = {"schema": SCHEMA, "passed": exit_code == 0, "exit_code": exit_code,
              "seconds": seconds,
              "settings": {"workers": options.workers, "mode": options.mode,
                           "epochs": options.epochs, "samples": options.samples,
                           "batch_size": options.batch_size, "hidden": options.hidden,
                           "lr": options.lr, "sync_every": options.sync_every,
                           "seed": options.seed},
              "modes": modes}
    if error is not None:
        report["error"] = error
    return report


def write_artefacts(options, report: dict) -> int | None:
    """Write the ``--report`` and ``--plot`` files ``options`` names, and say where; an exit
    code if one of them cannot be written."""
    for path, write, what in ((options.report, write_report, "report"),
                              (options.plot, write_plot, "plot")):
        if path is None:
            continue
        try:
            write(path, report)
        except OSError as error:
            print(f"gradstar demo: cannot write the {what} to {path}: {error.strerror or error}",
                  file=sys.stderr)
            return 1
        print(f"  {what:<12} {path}", flush=True)
    return None


def write_report(path: Path, report: dict) -> None:
    """Write ``report`` as JSON (creating the folder).

    Raises:
        OSError: the file cannot be written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def write_plot(path: Path, report: dict) -> None:
    """Loss and test accuracy per epoch, one line per mode in ``report`` and a dashed one for
    the same schedule trained in one process; a PNG at ``path`` (creating the folder).

    Raises:
        ImportError: matplotlib is not installed (see :func:`plot_unavailable`).
        OSError: the file cannot be written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(10, 4.2), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    loss, accuracy = figure.subplots(1, 2)
    for mode, run in report["modes"].items():
        epochs = run["epochs"]
        x = [e["epoch"] for e in epochs]
        who = "replicas" if mode == "streaming-diloco" else "ranks"
        line, = loss.plot(x, [e["loss"] for e in epochs], marker="o", markersize=3,
                          label=f"{mode}, {report['settings']['workers']} {who}")
        accuracy.plot(x, [100 * e["test_accuracy"] for e in epochs], marker="o",
                      markersize=3, color=line.get_color(), label=line.get_label())
        scratch = (run.get("single_process") or {}).get("from_scratch", {}).get("epochs", [])
        if scratch:
            sx = [e["epoch"] for e in scratch]
            label = f"{mode} schedule in 1 process"
            style = {"linestyle": "--", "marker": "x", "markersize": 5, "alpha": 0.7,
                     "color": line.get_color(), "label": label}
            loss.plot(sx, [e["loss"] for e in scratch], **style)
            accuracy.plot(sx, [100 * e["test_accuracy"] for e in scratch], **style)
    loss.set(title="training loss (mean over the epoch's batches)", xlabel="epoch",
             ylabel="cross-entropy")
    accuracy.set(title="test accuracy", xlabel="epoch", ylabel="%")
    for axes in (loss, accuracy):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.suptitle(f"gradstar demo: {', '.join(report['modes'])} "
                    f"({'passed' if report['passed'] else 'FAILED'})")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
