"""DataParallel on CUDA devices, proved against single-device training on cuda:0.

Replicas go on every visible GPU, or twice on cuda:0 on a machine with one (two replicas
sharing a GPU take the very path of two GPUs: copies of the parameters made at each forward,
their gradients summed into the primary's). In one process without a process group, and as
2 real processes x 2 replicas over a real coordinator (``tests/parallel``'s script and
reference), each over several optimizer steps.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from torch import nn

import gradstar
from gradstar.errors import ConfigurationError
from tests.parallel import data_parallel_script as script
from tests.parallel.conftest import reports_by_scenario, run_world

from .conftest import needs_cuda

pytestmark = needs_cuda

# float32 on a GPU: cuBLAS may pick other kernels (summation orders) for a shard than for the
# whole batch, so results agree to rounding.
RTOL, ATOL = 1e-4, 1e-5


def replica_devices() -> list[torch.device]:
    count = torch.cuda.device_count()
    return [torch.device("cuda", i) for i in range(count)] if count > 1 else \
        [torch.device("cuda", 0)] * 2


def reference(kind: str, micro_steps: int = 1) -> nn.Module:
    model = script.Net(0).to("cuda:0")
    script.train(model, script.optimizer(kind, model.parameters()), 0, 1, "cuda:0",
                 micro_steps=micro_steps)
    return model


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_replicas_on_cuda_devices_train_as_the_plain_module_on_the_whole_batch(kind):
    module = script.Net(0).to("cuda:0")
    model = gradstar.DataParallel(module, device_ids=replica_devices())
    script.train(model, script.optimizer(kind, model.parameters()), 0, 1, "cuda:0")
    want = reference(kind)
    for (name, p), q in zip(module.named_parameters(), want.parameters(), strict=True):
        assert p.device == torch.device("cuda", 0) and p.grad.device == p.device
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=name)
    assert not torch.equal(module.head.weight, script.Net(0).head.weight.cuda())


def test_default_device_ids_are_every_visible_cuda_device_and_outputs_can_go_to_the_cpu():
    module = script.Net(0).to("cuda:0")
    model = gradstar.DataParallel(module, output_device="cpu")
    assert model.device_ids == [torch.device("cuda", i)
                                for i in range(torch.cuda.device_count())]
    x = torch.randn(5, script.IN)
    out, hidden = model({"x": x.cuda()})
    assert out.device == hidden.device == torch.device("cpu")
    out.sum().backward()
    assert all(p.grad is not None and p.grad.is_cuda for p in module.parameters())
    with torch.no_grad():
        torch.testing.assert_close(out, module({"x": x.cuda()})[0].cpu(), rtol=RTOL, atol=ATOL)


def test_a_module_off_the_first_device_is_refused_naming_both():
    with pytest.raises(ConfigurationError, match=r"module must be on device_ids\[0\] "
                                                 r"\(cuda:0\), the primary replica's device; it "
                                                 r"is on cpu"):
        gradstar.DataParallel(script.Net(0), device_ids=[0])


def test_two_processes_of_two_cuda_replicas_match_one_process_on_the_whole_batch():
    devices = ",".join(str(d) for d in replica_devices()[:2])
    reports = asyncio.run(run_world(script.SCRIPT, 2, "dp-cuda", devices, timeout=200))
    runs = reports_by_scenario(reports, script.SCENARIOS, 2)
    for name, kind, micro in [("sgd", "sgd", 1), ("adam", "adam", 1), ("no_sync", "sgd", 2),
                              ("sync_by_hand", "sgd", 2)]:
        want = script.params_of(reference(kind, micro))
        for report in runs[name]:
            assert report["devices"] == ["cuda:0"] and report["replicas"] == 2
            for key, values in want.items():
                np.testing.assert_allclose(report["params"][key], values, rtol=RTOL, atol=ATOL,
                                           err_msg=f"{name}, rank {report['rank']}, {key}")
