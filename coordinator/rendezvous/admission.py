"""Who may take a place in the rendezvous' table: room for a new job (jobs that never formed
make way first), and a world size another rank disputes. What :meth:`.rendezvous.Rendezvous.
offer` checks before it registers a joiner; no I/O."""

from __future__ import annotations

from gradstar.errors import TooManyJobsError, WorldSizeMismatchError

from .jobs import Job


def make_room(jobs: dict[str, Job], job: str, max_jobs: int) -> None:
    """Make room in the table for new job ``job``: at the limit, the oldest job that never
    formed is evicted first (its joiners get :class:`TooManyJobsError`), so joins that never
    form cannot lock real jobs out.

    Raises:
        TooManyJobsError: the table holds ``max_jobs`` jobs that all formed.
    """
    if len(jobs) < max_jobs:
        return
    # Insertion order: the first unformed job found is the one waiting longest.
    victim = next((j for j in jobs.values() if not j.formed), None)
    if victim is None:
        raise TooManyJobsError(
            f"the coordinator holds {len(jobs)} jobs, its limit (coordinator "
            f"setting max_jobs); job {job!r} cannot join until finished jobs are "
            "dropped (after job_retention seconds)")
    del jobs[victim.name]
    error = TooManyJobsError(
        f"job {victim.name!r} was evicted before it formed: the coordinator holds "
        f"{max_jobs} jobs, its limit (coordinator setting max_jobs), and a new job "
        "needed the room; jobs that never formed go first")
    for waiting in victim.forming:
        if not waiting.joined.done():
            waiting.joined.set_exception(error)


def dispute_world_size(state: Job, asked: int) -> None:
    """Tell the ranks waiting for ``state`` to form that another rank disputes its world
    size: no generation of the size they asked for can form as configured, so each gets
    :class:`WorldSizeMismatchError` now instead of a join timeout later. A running
    generation is left alone (a stray process must not end a healthy job)."""
    for waiting in state.forming:
        if not waiting.joined.done():
            waiting.joined.set_exception(WorldSizeMismatchError(
                f"job {state.name!r} is forming with world_size {state.world_size}, but "
                f"another rank asked for {asked}; every rank must pass the same world_size"))


def check_limits(state: Job, max_world_size: int, min_world_size: int) -> None:
    """Refuse a joiner whose size limits differ from the job's (every rank passes the same
    ``max_world_size`` and ``min_world_size``, as torchrun's ``--nnodes MIN:MAX``); a joiner
    without limits takes the job's. Nothing changes for the others.

    Raises:
        WorldSizeMismatchError: a limit the joiner gave differs from the job's.
    """
    for name, asked, held in (("max_world_size", max_world_size, state.max_world_size),
                              ("min_world_size", min_world_size, state.min_world_size)):
        if asked and held and asked != held and (state.formed or state.forming):
            raise WorldSizeMismatchError(
                f"job {state.name!r} has {name} {held}, but this rank asked for {asked}; "
                f"every rank must pass the same {name}")


__all__ = ["check_limits", "dispute_world_size", "make_room"]
