"""Streaming DiLoCo replicas whose models live on cuda:0 (sharing it) equal the CPU reference of
the same algorithm, and their modules never leave the device."""

from __future__ import annotations

import numpy as np

from tests.integration.test_streaming_diloco import Replica, reference

from .conftest import needs_cuda

pytestmark = needs_cuda


async def test_streaming_rounds_on_cuda_equal_the_cpu_reference(coordinator, tmp_path):
    sdl = dict(h=6, p=3, tau=2, alpha=0.5, min_replicas=2, round_timeout=60, steps=24,
               device="cuda:0")
    replicas = [await Replica.start(tmp_path, coordinator.address, i, **sdl) for i in range(2)]
    try:
        results = [await r.result() for r in replicas]
    finally:
        for r in replicas:
            r.kill()
    glob, local = reference(2, 24, 6, 3, 2, 0.5)
    for i, res in enumerate(results):
        assert res["device"] == "cuda:0" and res["rounds"] == [4, 4, 4]
        # CUDA kernels round differently from the CPU's: float32 tolerance, not bit equality.
        np.testing.assert_allclose(res["global"], glob, rtol=0, atol=1e-4)
        np.testing.assert_allclose(res["params"], local[i], rtol=0, atol=1e-4)
