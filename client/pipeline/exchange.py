"""One pipeline call's messages between neighbouring stages (see
:mod:`gradstar.client.pipeline.pipeline` for the protocol): sends in flight, and receives
posted one micro-batch ahead, each tagged ``("pipe", pipeline, call, micro, kind)``."""

from __future__ import annotations

import time

import torch

from gradstar.client.device import to_device


class Exchange:
    """One call's messages: sends in flight, and receives posted one micro-batch ahead.

    ``pipe`` is the :class:`~gradstar.client.pipeline.Pipeline` (its process group, stage,
    device, timeout, micro-batch count and number); ``call`` numbers the call among that
    pipeline's calls, the same on every stage (a backward uses its forward's number)."""

    def __init__(self, pipe, call: int) -> None:
        self.pipe = pipe
        pipe.wait_seconds = 0.0
        self.call = call
        self.sends: list = []
        self.posted: dict[tuple[str, int], object] = {}

    def _tag(self, micro: int, kind: str) -> tuple:
        return ("pipe", self.pipe.number, self.call, micro, kind)

    def _recv(self, src: int, kind: str, micro: int) -> torch.Tensor:
        pg, m = self.pipe.pg, self.pipe.num_microbatches
        for i in (micro, micro + 1):
            if i < m and (kind, i) not in self.posted:
                self.posted[kind, i] = pg.recv(src, self._tag(i, kind), async_op=True,
                                               timeout=self.pipe.timeout)
        started = time.perf_counter()
        value = self.posted.pop((kind, micro)).wait()
        self.pipe.wait_seconds += time.perf_counter() - started
        if not isinstance(value, torch.Tensor):
            value = torch.from_numpy(value)
        if value.device != self.pipe.device:
            # The wire carries no device: a message arrives in host memory.
            value = to_device(value, self.pipe.device)
        return value

    def recv_activation(self, micro: int) -> torch.Tensor:
        x = self._recv(self.pipe.stage - 1, "act", micro)
        if x.is_floating_point() and torch.is_grad_enabled():
            x.requires_grad_(True)
        return x

    def recv_gradient(self, micro: int) -> torch.Tensor:
        return self._recv(self.pipe.stage + 1, "grad", micro)

    def send_activation(self, micro: int, out: torch.Tensor) -> None:
        self._send(self.pipe.stage + 1, "act", micro, out)

    def send_gradient(self, micro: int, grad: torch.Tensor) -> None:
        self._send(self.pipe.stage - 1, "grad", micro, grad)

    def _send(self, dst: int, kind: str, micro: int, t: torch.Tensor) -> None:
        self.sends.append(self.pipe.pg.send(t.detach(), dst, self._tag(micro, kind),
                                            async_op=True, timeout=self.pipe.timeout))

    def finish(self) -> None:
        """Wait until every neighbour holds what this stage sent."""
        started = time.perf_counter()
        for work in self.sends:
            work.wait()
        self.pipe.wait_seconds += time.perf_counter() - started


__all__ = ["Exchange"]
