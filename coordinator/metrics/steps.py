"""Prometheus series of DDP's sync-mode step ledgers (:mod:`gradstar.coordinator.steps`): per
model (steps closed, live ranks, drops), per staleness and per rank. :mod:`.prometheus` renders
them beside the rounds' series."""

from __future__ import annotations


def steps_families(family, labels, steps) -> None:
    """Call ``family(name, kind, help, samples)`` for each family of the ledgers in ``steps``
    (a :class:`~gradstar.coordinator.steps.StepsTable`); ``labels`` formats a label set."""
    out: dict[str, list[str]] = {name: [] for name, _, _ in STEPS_FAMILIES}
    for view in steps.summaries():
        model = {"job": view.job, "model": view.model}
        for name, value in (("gradstar_steps_closed", view.steps),
                            ("gradstar_steps_live_ranks", len(view.live)),
                            ("gradstar_steps_dropped_total", view.dropped)):
            out[name].append(f"{name}{labels(model)} {value}")
        for stale, n in view.staleness.items():
            out["gradstar_steps_staleness_total"].append(
                f"gradstar_steps_staleness_total{labels({**model, 'staleness': str(stale)})} {n}")
        for r in view.ranks:
            rank = labels({**model, "rank": str(r.rank)})
            out["gradstar_steps_rank_contributions_total"].append(
                f"gradstar_steps_rank_contributions_total{rank} {r.contributed}")
            out["gradstar_steps_rank_dropped_total"].append(
                f"gradstar_steps_rank_dropped_total{rank} {r.dropped}")
            out["gradstar_steps_rank_live"].append(
                f"gradstar_steps_rank_live{rank} {int(r.live)}")
    for name, kind, help_text in STEPS_FAMILIES:
        family(name, kind, help_text, out[name])


STEPS_FAMILIES = (
    ("gradstar_steps_closed", "gauge", "Steps closed on a sync-mode DDP model's ledger."),
    ("gradstar_steps_live_ranks", "gauge", "Ranks in the ledger's live set."),
    ("gradstar_steps_dropped_total", "counter",
     "Contributions dropped as too stale (Quorum: any; BoundedStaleness: over the bound)."),
    ("gradstar_steps_staleness_total", "counter",
     "Contributions taken into steps, by staleness (steps closed since their parameters)."),
    ("gradstar_steps_rank_contributions_total", "counter",
     "Contributions of the rank taken into steps."),
    ("gradstar_steps_rank_dropped_total", "counter", "Contributions of the rank dropped."),
    ("gradstar_steps_rank_live", "gauge", "1 while the rank is in the ledger's live set."),
)
