"""Several coordinators, one leader (``gradstar coordinator --ha etcd://...``): :mod:`.etcd`
is the few etcd v3 calls an election needs, over etcd's JSON gateway; :mod:`.election` the
election itself, the leadership term that fences a leader that lost its lease, and the
standby that takes over."""

from .election import MARGIN, Leadership, Role
from .etcd import Etcd, endpoints_of, tls_context

__all__ = ["MARGIN", "Etcd", "Leadership", "Role", "endpoints_of", "tls_context"]
