"""What each collective means, read by the hub and the ranks alike (``from gradstar import
ops``; every name below is re-exported here):

- :mod:`.table`: one record per op (:class:`Op`: wire enum, whether the hub reduces it, its
  layout and exchange, its preconditions, the in-place rule, whether it takes a wire format),
  the names of reduce ops and averaging rules, and the dispatchers that read the records
  (:func:`geometry`, :func:`input_layout`, :func:`routes`, :func:`check_preconditions`);
- :mod:`.geometry`: which chunks every rank sends and receives for each layout and exchange,
  and how chunks stripe over hub shards;
- :mod:`.call`: :class:`CollectiveCall`, the value derived once per header that the hub's
  engine and the rank's stream both carry, and :func:`check_encoding`.
"""

from .call import CACHED_CALLS, CallCache, CollectiveCall, call_fields, check_encoding, geometry_of
from .geometry import (
    Exchange,
    Geometry,
    Indices,
    Layout,
    active_shards,
    in_stripe,
    plan_length,
    stripe_indices,
    stripe_of,
)
from .table import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    AVERAGING_RULES,
    BARRIER,
    BROADCAST,
    OP_NAMES,
    OPS,
    REDUCE_OP_NAMES,
    REDUCE_OPS,
    REDUCE_SCATTER,
    REDUCING,
    RULE_NAMES,
    Facts,
    Op,
    Precondition,
    averaging_rule,
    check_preconditions,
    geometry,
    input_layout,
    op_name,
    op_record,
    reduce_op,
    routes,
)

__all__ = [
    "ALL_GATHER", "ALL_REDUCE", "ALL_TO_ALL", "AVERAGING_RULES", "BARRIER", "BROADCAST",
    "CACHED_CALLS", "OPS", "OP_NAMES", "REDUCE_OPS", "REDUCE_OP_NAMES", "REDUCE_SCATTER",
    "REDUCING", "RULE_NAMES", "CallCache", "CollectiveCall", "Exchange", "Facts", "Geometry",
    "Indices", "Layout", "Op", "Precondition", "active_shards", "averaging_rule", "call_fields",
    "check_encoding", "check_preconditions", "geometry", "geometry_of", "in_stripe",
    "input_layout", "op_name", "op_record", "plan_length", "reduce_op", "routes",
    "stripe_indices", "stripe_of"
]
