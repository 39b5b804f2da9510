"""Data paths: a gradstar configuration runs on the same-host shared-memory fast path (``shm``)
or on the gRPC stream (``stream``), chosen with ``GRADSTAR_SHARED_MEMORY`` in the environment
of both the coordinator and the ranks (:func:`path_env`, the ``env`` of
:class:`~_processes.CoordinatorProcess` and :func:`~_ranks.run_ranks`); each rank reports what
its group used (:func:`shm_report`) and :func:`check_path` fails a configuration whose ranks did
not take the path it is labelled with. :func:`add_paths_argument`: the ``--paths`` option.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from _processes import BenchmarkError

#: How a rank's chunks reach a hub on its host: through a shared-memory segment the hub maps
#: (``shm``, gradstar's default there) or as frames on the gRPC stream (``stream``, the only
#: path to a hub on another host).
PATHS = ("shm", "stream")


def add_paths_argument(parser: argparse.ArgumentParser) -> None:
    """``--paths``: which data paths gradstar runs on, each a configuration of its own."""
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS),
                        help="run gradstar once per data path: shm (the same-host shared-memory "
                             "fast path) and/or stream (chunks on the gRPC stream, "
                             "GRADSTAR_SHARED_MEMORY=0 for the coordinator and the ranks); "
                             "default both")


def path_env(path: str) -> dict[str, str]:
    """The environment of the coordinator and the ranks of a configuration on ``path``. Set
    either way, so that a GRADSTAR_SHARED_MEMORY in the caller's environment cannot change
    the path a configuration is labelled with."""
    if path not in PATHS:
        raise ValueError(f"unknown data path {path!r}; expected one of {PATHS}")
    return {"GRADSTAR_SHARED_MEMORY": "1" if path == "shm" else "0"}


def shm_report(group) -> dict:
    """Run in a rank, after its timed loop and before it closes ``group`` (a gradstar
    ProcessGroup or AsyncProcessGroup): which data path its collectives took, for
    :func:`check_path`. ``shm_offered`` has one entry per target of the group's collectives (the
    hub, or each hub shard): whether the rank still offers it shared memory, which it stops
    doing for good once the target refuses (the reasons are in ``shm_refused``)."""
    from gradstar.transport import shm

    # The SDK has no public "which path did my collectives take": read the data plane.
    plane = getattr(group, "_group", group)._plane
    targets = plane.targets()
    return {"shm_supported": shm.supported(),
            "shm_offered": [t.shm.enabled for t in targets],
            "shm_refused": [f"{t.name}: {t.shm.refused}" for t in targets if t.shm.refused]}


def check_path(results: Sequence[dict], path: str, label: str,
               hub_mappings: int | None = None) -> None:
    """Raise :class:`BenchmarkError` unless every rank's collectives took ``path``, as each
    reported with :func:`shm_report`: for ``shm``, every target of every rank attached its
    segments; for ``stream``, none was offered any. ``hub_mappings``, if known
    (:meth:`CoordinatorProcess.shm_mappings` while the ranks were alive), must agree: some
    for ``shm``, none for ``stream``."""
    problems = []
    for rank, r in enumerate(results):
        if "shm_offered" not in r:
            problems.append(f"rank {rank} did not report its data path")
        elif path == "shm" and not r["shm_supported"]:
            problems.append(f"rank {rank}: this system has no sealable memfds")
        elif path == "shm" and not (r["shm_offered"] and all(r["shm_offered"])):
            why = "; ".join(r["shm_refused"]) or "no target took an offer"
            problems.append(f"rank {rank}: {why}")
        elif path == "stream" and any(r["shm_offered"]):
            problems.append(f"rank {rank} still offered shared memory to "
                            f"{sum(r['shm_offered'])} of its targets")
    if hub_mappings is not None and (hub_mappings > 0) != (path == "shm"):
        problems.append(f"the hub had {hub_mappings} ranks' segments mapped")
    if problems:
        raise BenchmarkError(f"[{label}] the configuration labelled {path!r} did not use the "
                             f"{path} data path: " + "; ".join(problems))


__all__ = ["PATHS", "add_paths_argument", "check_path", "path_env", "shm_report"]
