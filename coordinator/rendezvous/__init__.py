"""The rendezvous: jobs, their generations and members, and member liveness.

:mod:`.rendezvous` is the state machine (no I/O), :mod:`.jobs` its records (jobs, generations,
members, job-name checks, peer-stream keys) and :mod:`.servicer` the gRPC session stream that
drives it.
"""

from .jobs import Generation, Job, JobCounters, Member, check_job_name, pair_key
from .rendezvous import Rendezvous
from .servicer import RendezvousServicer

__all__ = [
    "Generation",
    "Job",
    "JobCounters",
    "Member",
    "Rendezvous",
    "RendezvousServicer",
    "check_job_name",
    "pair_key",
]
