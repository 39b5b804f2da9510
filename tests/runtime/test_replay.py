"""The single-process reference the demo checks against, checked itself against torch.optim."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradstar.errors import ConfigurationError
from gradstar.worker.demo.modes import MomentumSGD, pipeline_stage
from gradstar.worker.demo.replay import SingleProcessRun
from gradstar.worker.demo.spirals import flat_parameters, make_model, make_spirals
from gradstar.worker.demo.train import Schedule, TrainSettings

# 240 training rows, global batch 16 on 2 ranks: 15 steps.
SMALL = {"samples": 300, "batch_size": 8, "epochs": 1, "hidden": 16}


def torch_sgd_step(model, opt, data, rows) -> None:
    x, y = torch.from_numpy(data.train.x[rows]), torch.from_numpy(data.train.y[rows])
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_momentum_sgd_is_torch_sgds_update_exactly():
    # torch.optim.SGD.step runs torch.optim.sgd.sgd with the buffers it keeps, None before the
    # first step (created there); MomentumSGD starts from zeros instead. Same numbers, bit for bit.
    from torch.optim.sgd import sgd

    data = make_spirals(300)
    ours, theirs = make_model(2, 3, 16), make_model(2, 3, 16)
    opt = MomentumSGD(ours.parameters(), 0.1, 0.9)
    params = list(theirs.parameters())
    buffers = [None] * len(params)
    for step in range(5):
        rows = np.arange(step * 16, (step + 1) * 16)
        torch_sgd_step(ours, opt, data, rows)
        x, y = torch.from_numpy(data.train.x[rows]), torch.from_numpy(data.train.y[rows])
        for p in params:
            p.grad = None
        torch.nn.functional.cross_entropy(theirs(x), y).backward()
        with torch.no_grad():
            sgd(params, [p.grad for p in params], buffers, weight_decay=0.0, momentum=0.9,
                lr=0.1, dampening=0.0, nesterov=False, maximize=False)
    np.testing.assert_array_equal(flat_parameters(ours), flat_parameters(theirs))


def test_ddp_reference_is_one_model_on_whole_batches():
    settings = TrainSettings(mode="ddp", **SMALL)
    run = SingleProcessRun(settings, world=2)
    run.run(0, run.schedule.total_steps)
    model = make_model(2, 3, 16)
    opt = MomentumSGD(model.parameters(), 0.1, 0.9)
    for step in range(run.schedule.total_steps):
        torch_sgd_step(model, opt, run.data, run.schedule.global_rows(step))
    np.testing.assert_array_equal(run.parameters()[0], flat_parameters(model))


def test_localsgd_reference_averages_replicas_every_h_steps_and_at_the_end():
    settings = TrainSettings(mode="localsgd", sync_every=4, **SMALL)
    run = SingleProcessRun(settings, world=2)
    total = run.schedule.total_steps
    assert total % 4  # the last stretch is shorter: the final average must still happen
    run.run(0, total)
    replicas = [make_model(2, 3, 16) for _ in range(2)]
    opts = [MomentumSGD(m.parameters(), 0.1, 0.9) for m in replicas]
    for step in range(total):
        for r in range(2):
            torch_sgd_step(replicas[r], opts[r], run.data, run.schedule.rank_rows(step, r))
        if (step + 1) % 4 == 0 or step + 1 == total:
            mean = np.mean([flat_parameters(m) for m in replicas], axis=0, dtype=np.float32)
            for m in replicas:
                offset = 0
                with torch.no_grad():
                    for p in m.parameters():
                        p.copy_(torch.from_numpy(mean[offset:offset + p.numel()]).view_as(p))
                        offset += p.numel()
    for got in run.parameters():
        np.testing.assert_array_equal(got, flat_parameters(replicas[0]))


def test_ranks_slice_the_global_batch_without_overlap():
    schedule = Schedule(rows=100, global_batch=12, world=3, epochs=2, seed=5)
    assert schedule.steps_per_epoch == 8
    for step in (0, 7, 8, 15):
        slices = [schedule.rank_rows(step, r) for r in range(3)]
        np.testing.assert_array_equal(np.concatenate(slices), schedule.global_rows(step))
    epoch = np.concatenate([schedule.global_rows(s) for s in range(8)])
    assert len(set(epoch.tolist())) == 96  # every row at most once per epoch
    assert not np.array_equal(schedule.global_rows(0), schedule.global_rows(8))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_pipeline_stages_are_the_layers_in_order(world):
    model = make_model(2, 3, 16)
    stages = [pipeline_stage(model, r, world) for r in range(world)]
    assert [layer for s in stages for layer in s] == list(model)


def test_a_pipeline_has_at_most_one_stage_per_layer():
    with pytest.raises(ConfigurationError, match="at most 5 ranks, not 6"):
        pipeline_stage(make_model(2, 3, 16), 0, 6)


def test_the_dataset_is_deterministic_and_not_linearly_trivial():
    a, b = make_spirals(900, seed=3), make_spirals(900, seed=3)
    np.testing.assert_array_equal(a.train.x, b.train.x)
    np.testing.assert_array_equal(a.test.y, b.test.y)
    assert len(a.train) == 720 and len(a.test) == 180
    assert sorted(np.unique(a.train.y).tolist()) == [0, 1, 2]
    # Least squares on the raw features (a linear classifier) stays far from a good fit.
    features = np.c_[a.train.x, np.ones(len(a.train))]
    onehot = np.eye(3)[a.train.y]
    weights, *_ = np.linalg.lstsq(features, onehot, rcond=None)
    assert np.mean((features @ weights).argmax(1) == a.train.y) < 0.7
