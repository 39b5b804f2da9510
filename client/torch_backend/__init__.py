"""gradstar as a torch.distributed backend: ``import gradstar.client.torch_backend`` registers
backend ``"gradstar"`` and init_method ``gradstar://`` (``import gradstar`` does it too, once
torch is imported; see :mod:`gradstar.client.torch_import_hook`).

How a script uses it is in :mod:`.backend`; what each torch call becomes in :mod:`.group`; how
results reach torch (threads, futures, errors) in :mod:`.work`; tensor conversion in
:mod:`.convert`; the compressed-gradients communication hook for torch's DDP in
:mod:`.comm_hooks`, and the Quorum sync mode's in :mod:`.quorum_hook`.
"""

from .backend import (
    BACKEND,
    parse_init_method,
    register_backend,
    shutdown_all,
)
from .comm_hooks import WireHookState, wire_compress_hook
from .convert import reduce_op_name
from .group import BackendUnsupportedError, ProcessGroupGradstar
from .quorum_hook import QuorumHookState, quorum_hook
from .work import GradstarWork

register_backend()

__all__ = [
    "BACKEND",
    "BackendUnsupportedError",
    "GradstarWork",
    "ProcessGroupGradstar",
    "QuorumHookState",
    "WireHookState",
    "parse_init_method",
    "quorum_hook",
    "reduce_op_name",
    "register_backend",
    "shutdown_all",
    "wire_compress_hook",
]
