"""gradstar.client.device: which devices are accepted, the pinned-memory budget, and the staged
conversion (a host copy at call time, the result copied back) exercised on CPU tensors by
declaring the CPU a staged device. The CUDA runs of the same path are in tests/cuda/."""

from __future__ import annotations

import gc
import threading

import ml_dtypes
import numpy as np
import pytest
import torch

from gradstar.client import convert, device
from gradstar.errors import ConfigurationError


@pytest.fixture
def staged_cpu(monkeypatch):
    """CPU tensors take the staged path (host copy in, copy back out), as CUDA tensors do."""
    monkeypatch.setattr(device, "STAGED_DEVICES", ("cuda", "cpu"))


@pytest.mark.parametrize("where", ["meta"])
def test_a_tensor_on_another_device_is_refused_naming_it(where):
    t = torch.empty(3, device=where)
    with pytest.raises(ConfigurationError) as raised:
        convert.to_numpy(t)
    assert str(raised.value) == ("gradstar moves CPU and CUDA tensors; this tensor is on meta: "
                                 "call .cpu() first")


def test_cpu_and_cuda_tensors_are_accepted():
    device.check_device(torch.zeros(2))
    assert not device.is_staged(torch.zeros(2))
    # A CUDA tensor cannot be made here; its device type is what decides.
    assert "cuda" in device.STAGED_DEVICES


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int32, torch.int64])
def test_a_staged_tensor_is_copied_at_call_time_and_restored_alike(staged_cpu, dtype):
    t = (torch.arange(24) - 7).reshape(4, 6).to(dtype).t()  # non-contiguous on purpose
    arr, restore = convert.to_numpy(t)
    want = t.contiguous()
    assert arr.shape == (6, 4) and arr.flags.c_contiguous
    # A copy, not a view: the caller may overwrite its tensor once the call returned.
    t.fill_(0)
    wire = np.asarray(arr).view(np.int16) if dtype == torch.bfloat16 else arr
    expect = want.view(torch.int16) if dtype == torch.bfloat16 else want
    np.testing.assert_array_equal(wire, expect.numpy())
    back = restore(arr.copy())
    assert back.dtype == dtype and back.shape == (6, 4) and back.device.type == "cpu"
    assert torch.equal(back, want)
    if dtype == torch.bfloat16:
        assert arr.dtype == ml_dtypes.bfloat16


def test_a_staged_zero_dim_tensor_keeps_its_shape(staged_cpu):
    t = torch.tensor(2.5, dtype=torch.bfloat16)
    arr, restore = convert.to_numpy(t)
    assert arr.shape == ()
    assert restore(arr.copy()).shape == ()


def test_the_budget_counts_buffers_until_they_are_collected():
    budget = device.PinnedBudget(limit=1000)
    assert budget.take(600)
    buffer = torch.empty(150)  # 600 bytes
    budget.track(buffer, 600)
    assert budget.take(100)
    budget.give_back(100)
    assert not budget.take(600)  # over the bound: the caller stages through pageable memory
    assert budget.held == 600
    del buffer
    gc.collect()
    assert budget.held == 0
    assert budget.take(1000)


def test_the_budget_is_exact_under_threads():
    budget = device.PinnedBudget(limit=10_000)
    granted = []

    def grab():
        for _ in range(1000):
            if budget.take(7):
                granted.append(7)

    threads = [threading.Thread(target=grab) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sum(granted) == budget.held <= budget.limit
    assert budget.held > budget.limit - 7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_staged_array_keeps_its_pinned_bytes_counted(staged_cpu, monkeypatch, dtype):
    """The numpy array handed to the wire, and every view of it, keeps the counted host buffer
    alive: its bytes stay counted until the last view is gone (bfloat16 included, which goes
    through an int16 view)."""
    budget = device.PinnedBudget(limit=1 << 20)
    monkeypatch.setattr(device, "_budget", budget)
    # No CUDA here: count a CPU buffer as a pinned one would be counted.
    monkeypatch.setattr(device, "_pins", lambda t: True)
    monkeypatch.setattr(device, "_allocate",
                        lambda shape, dtype, pinned: torch.empty(shape, dtype=dtype))
    arr, _ = convert.to_numpy(torch.ones(64, dtype=dtype))
    view = arr[10:20]
    del arr
    gc.collect()
    assert budget.held == 64 * dtype.itemsize
    del view
    gc.collect()
    assert budget.held == 0


def test_pageable_memory_beyond_the_budget(staged_cpu, monkeypatch):
    budget = device.PinnedBudget(limit=200)
    monkeypatch.setattr(device, "_budget", budget)
    monkeypatch.setattr(device, "_pins", lambda t: True)
    pinned = []
    monkeypatch.setattr(device, "_allocate", lambda shape, dtype, p: (
        pinned.append(p), torch.empty(shape, dtype=dtype))[1])
    # 80 bytes count as the 128-byte block torch's caching host allocator makes of them.
    _small, _ = convert.to_numpy(torch.ones(20))  # pinned (and held)
    big, _ = convert.to_numpy(torch.ones(20))  # 128 more would pass the bound: pageable
    assert pinned == [True, False]
    assert budget.held == 128
    np.testing.assert_array_equal(big, np.ones(20, dtype=np.float32))


def test_pageable_memory_when_pinning_fails(staged_cpu, monkeypatch):
    budget = device.PinnedBudget(limit=1 << 20)
    monkeypatch.setattr(device, "_budget", budget)
    monkeypatch.setattr(device, "_pins", lambda t: True)

    def allocate(shape, dtype, pinned):
        if pinned:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return torch.empty(shape, dtype=dtype)

    monkeypatch.setattr(device, "_allocate", allocate)
    arr, _ = convert.to_numpy(torch.arange(5.0))
    np.testing.assert_array_equal(arr, np.arange(5.0, dtype=np.float32))
    assert budget.held == 0


@pytest.mark.parametrize(("raw", "limit"), [("", device.DEFAULT_PINNED_LIMIT), ("0", 0),
                                            ("1.5", 3 << 19)])
def test_the_pinned_limit_comes_from_the_environment(monkeypatch, raw, limit):
    monkeypatch.setenv(device.PINNED_LIMIT_ENV, raw)
    assert device._limit_from_env() == limit


@pytest.mark.parametrize("raw", ["lots", "-1"])
def test_a_bad_pinned_limit_is_a_named_error(monkeypatch, raw):
    monkeypatch.setenv(device.PINNED_LIMIT_ENV, raw)
    with pytest.raises(ConfigurationError, match="GRADSTAR_PINNED_LIMIT_MB must be"):
        device._limit_from_env()
