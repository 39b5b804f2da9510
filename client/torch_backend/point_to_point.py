"""Point to point in gradstar's torch.distributed process group: ``send``, ``recv`` (from one
rank or any) and torch's all_to_all, which all ride gradstar's peer streams rather than the hub's
collective streams (an all_to_all's plans are checked through the hub, its payload goes rank to
rank).

:class:`PointToPoint` is mixed into :class:`~gradstar.client.torch_backend.group.
ProcessGroupGradstar`, which gives it ``gradstar_group``, ``size()`` and its ``launcher``
(:class:`~.launcher.Launcher`). torch's
list form of all_to_all is one flat ``all_to_all_single`` of the concatenated tensors. A receive
from any source reports the sender as torch's Work does (``work._source_rank()``, which
``dist.recv`` returns): :class:`AnySourceWork`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from gradstar.client.process_group.protocol import PeerGroup
from gradstar.errors import GradstarError, InvalidCollectiveError

from .convert import (
    check_dense,
    check_numel,
    for_transfer,
    rows_for_transfer,
    seconds_of,
    tensor_list,
)
from .profiling import record_collectives
from .work import CompletionThreads, GradstarWork


class BackendUnsupportedError(GradstarError, NotImplementedError):
    """The gradstar torch.distributed backend does not implement this operation (yet)."""


class AnySourceWork(GradstarWork):
    """The Work of a receive from any rank: :meth:`_source_rank` names the sender (what torch's
    ``dist.recv(src=None)`` returns), once the message is in torch's tensor."""

    def __init__(self, pending, finish, completions: CompletionThreads, **options) -> None:
        senders: list[int] = []

        def noted(results):
            senders.extend(sender for sender, _ in results)
            return finish(results)

        super().__init__(pending, noted, completions, **options)
        self._senders = senders

    def _source_rank(self) -> int:
        """The rank the message came from; waits for it.

        Raises:
            GradstarError: the receive failed.
        """
        self.wait()
        return self._senders[0]

    source_rank = _source_rank


def rides_peer_streams(call: str) -> Callable[[Callable], Callable]:
    """Declares a torch method (torch's ``call``) that rides the gradstar group's peer streams:
    over a group without them (not a :class:`~gradstar.client.process_group.protocol.
    PeerGroup`) it raises :class:`BackendUnsupportedError` naming ``call``, before anything
    else."""
    def declare(method: Callable) -> Callable:
        @functools.wraps(method)
        def checked(self, *args, **kwargs):
            if not isinstance(self.gradstar_group, PeerGroup):
                raise BackendUnsupportedError(
                    f"torch.distributed {call} over the gradstar backend rides gradstar's peer "
                    "streams (ProcessGroup.send/recv), which this gradstar does not have yet; "
                    "use collectives, or backend 'gloo' for point-to-point traffic")
            return method(self, *args, **kwargs)
        return checked
    return declare


@record_collectives
class PointToPoint:
    """torch's send, recv and all_to_all over gradstar's peer streams (a mixin of the process
    group: only its public ``gradstar_group``, ``size()`` and ``launcher``; see the module
    docstring)."""

    @rides_peer_streams("send")
    def send(self, tensors, dst, tag=0):
        send = self.gradstar_group.send
        tensors = tensor_list(tensors)
        prepared = [for_transfer(t) for t in tensors]
        return self.launcher.launch([lambda w=w: send(w, dst, tag, async_op=True)
                             for w, _ in prepared], lambda _results: tensors, tensors)

    @rides_peer_streams("recv")
    def recv(self, tensors, src, tag=0):
        recv = self.gradstar_group.recv
        tensors = tensor_list(tensors)
        prepared = [for_transfer(t) for t in tensors]

        def finish(results):
            for t, (_, restore), r in zip(tensors, prepared, results, strict=True):
                t.copy_(restore(torch.as_tensor(r)).reshape(t.shape))
            return tensors

        return self.launcher.launch([lambda: recv(src, tag, async_op=True) for _ in prepared],
                            finish, tensors)

    @rides_peer_streams("recv")
    def recv_anysource(self, tensors, tag=0):
        """torch's recv with ``src=None``: the next message with ``tag`` from any rank; the
        Work's ``_source_rank()`` names its sender."""
        recv = self.gradstar_group.recv
        tensors = tensor_list(tensors)
        prepared = [for_transfer(t) for t in tensors]

        def finish(results):
            for t, (_, restore), (_, r) in zip(tensors, prepared, results, strict=True):
                t.copy_(restore(torch.as_tensor(r)).reshape(t.shape))
            return tensors

        return self.launcher.launch([lambda: recv(None, tag, async_op=True) for _ in prepared],
                            finish, tensors, AnySourceWork)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """torch's all_to_all_single: rows (dim 0) of ``input`` split by
        ``input_split_sizes`` go to the ranks; ``output`` receives their splits for this rank,
        ``output_split_sizes[i]`` rows from rank ``i`` (empty sizes: equal splits)."""
        world = self.size()
        check_dense(output)
        if output.dtype != input.dtype:
            raise InvalidCollectiveError(
                f"all_to_all_single's output is {output.dtype} but its input is {input.dtype}")
        if output.dim() == 0:
            raise InvalidCollectiveError("all_to_all_single needs tensors of at least 1 "
                                         "dimension")
        wire, write = rows_for_transfer(input)
        outs = list(output_split_sizes) or None
        if outs is None:
            if output.shape[0] % world:
                raise InvalidCollectiveError(
                    f"output_split_sizes is empty, so the output's dim 0 ({output.shape[0]}) "
                    f"must be divisible by world_size {world}")
            outs = [output.shape[0] // world] * world
        if len(outs) == world and sum(outs) != output.shape[0]:
            raise InvalidCollectiveError(
                f"output_split_sizes {outs} sums to {sum(outs)}, but the output's dim 0 is "
                f"{output.shape[0]}")
        ins = list(input_split_sizes) or None

        def finish(results):
            write(torch.as_tensor(results[0]), output)
            return [output]

        return self.launcher.launch([lambda: self.gradstar_group.all_to_all_single(
            wire, outs, ins, async_op=True, timeout=seconds_of(opts))], finish, [output, input])

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """torch's all_to_all: ``input_tensors[j]`` goes to rank ``j``; ``output_tensors[i]``
        receives rank ``i``'s. One flat all_to_all_single of the concatenated tensors, so every
        rank checks every size (a rank sending other sizes than another expects fails all)."""
        world = self.size()
        inputs, outputs = tensor_list(input_tensors), tensor_list(output_tensors)
        check_numel("all_to_all's input list", len(inputs), world)
        check_numel("all_to_all's output list", len(outputs), world)
        sent = [for_transfer(t) for t in inputs]
        taken = [for_transfer(o) for o in outputs]
        flat = torch.cat([w.reshape(-1) for w, _ in sent])
        sizes = [w.numel() for w, _ in taken]

        def finish(results):
            parts = torch.split(torch.as_tensor(results[0]), sizes)
            for out, (_, restore), part in zip(outputs, taken, parts, strict=True):
                out.copy_(restore(part).reshape(out.shape))
            return outputs

        return self.launcher.launch([lambda: self.gradstar_group.all_to_all_single(
            flat, sizes, [w.numel() for w, _ in sent], async_op=True,
            timeout=seconds_of(opts))], finish, [outputs, inputs])


__all__ = ["AnySourceWork", "BackendUnsupportedError", "PointToPoint", "rides_peer_streams"]
