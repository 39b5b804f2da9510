"""tests/parallel/test_torch_backend_waited.py on CUDA tensors: a collective whose torch caller
waits at once runs to its end on the caller's thread and its current stream, and comes back
settled, with no completion thread; results exact and on the device."""

from __future__ import annotations

import pytest

from tests.parallel.test_torch_backend_waited import check_reports, run_ranks

from .conftest import needs_cuda

pytestmark = [needs_cuda, pytest.mark.timeout(120)]


async def test_a_waited_cuda_collective_is_settled_on_the_callers_thread(start_coordinator):
    coordinator = await start_coordinator()
    check_reports(await run_ranks(coordinator.address, "cuda"), "cuda")
