"""``gradstar admin``: :mod:`.client` calls the coordinator's Admin and health services,
:mod:`.command` runs each action and :mod:`.tables` renders what comes back (tables for people,
dicts for ``--json``)."""

from .client import AdminClient
from .command import run_admin

__all__ = ["AdminClient", "run_admin"]
