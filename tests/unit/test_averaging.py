"""The averaging store driven directly: rules, staging, persistence."""

from __future__ import annotations

import numpy as np
import pytest

from gradstar.coordinator.rounds import AveragingStore
from gradstar.errors import InvalidCollectiveError
from gradstar.proto.v1 import collective_pb2 as pb


def spec(rule, lr=0.0, mu=0.0, model="global"):
    return pb.AveragingSpec(model=model, rule=rule, outer_lr=lr, outer_momentum=mu)


def run_round(store, rule, mean, lr=0.0, mu=0.0, job="job", chunk=3):
    """Apply a round chunk by chunk, as the hub does, and commit it; return what ranks get."""
    rnd = store.open_round(job, spec(rule, lr, mu), mean.shape[0])
    out = mean.astype(np.float32).copy()
    for start in range(0, out.shape[0], chunk):
        rnd.apply(start, out[start:start + chunk])
    rnd.commit()
    return out


def test_seed_stores_the_mean_then_answers_the_stored_model():
    store = AveragingStore()
    first = np.arange(7, dtype=np.float32)
    assert np.array_equal(run_round(store, pb.AVERAGING_RULE_SEED, first), first)
    model = store.get("job", "global")
    assert model.rounds == 0 and np.array_equal(model.params, first)

    answered = run_round(store, pb.AVERAGING_RULE_SEED, np.full(7, 99, np.float32))
    assert np.array_equal(answered, first)
    assert store.get("job", "global").params is model.params


def test_average_replaces_the_model_with_the_mean_and_counts_rounds():
    store = AveragingStore()
    run_round(store, pb.AVERAGING_RULE_SEED, np.zeros(5, np.float32))
    mean = np.linspace(0, 1, 5, dtype=np.float32)
    assert np.array_equal(run_round(store, pb.AVERAGING_RULE_AVERAGE, mean), mean)
    assert store.get("job", "global").rounds == 1


def test_outer_nesterov_matches_a_hand_computed_step_over_two_rounds():
    store = AveragingStore()
    theta = np.array([1.0, -2.0, 0.5, 4.0], np.float32)
    run_round(store, pb.AVERAGING_RULE_SEED, theta)
    lr, mu = np.float32(0.7), np.float32(0.9)
    momentum = np.zeros(4, np.float32)
    for delta in (np.array([0.1, 0.2, -0.3, 0.0], np.float32),
                  np.array([-0.05, 0.4, 0.1, 1.0], np.float32)):
        momentum = mu * momentum + delta
        theta = theta - lr * (delta + mu * momentum)
        got = run_round(store, pb.AVERAGING_RULE_OUTER_NESTEROV, delta, lr, mu)
        np.testing.assert_allclose(got, theta, rtol=1e-6)
    np.testing.assert_allclose(store.get("job", "global").momentum, momentum, rtol=1e-6)


def test_outer_sgd_without_momentum_is_a_plain_step():
    store = AveragingStore()
    run_round(store, pb.AVERAGING_RULE_SEED, np.ones(3, np.float32))
    got = run_round(store, pb.AVERAGING_RULE_OUTER_SGD, np.full(3, 0.5, np.float32), lr=0.2)
    np.testing.assert_allclose(got, np.full(3, 0.9), rtol=1e-6)


def test_an_uncommitted_round_changes_nothing():
    store = AveragingStore()
    run_round(store, pb.AVERAGING_RULE_SEED, np.ones(4, np.float32))
    rnd = store.open_round("job", spec(pb.AVERAGING_RULE_OUTER_NESTEROV, 0.5, 0.9), 4)
    rnd.apply(0, np.full(4, 3.0, np.float32))
    model = store.get("job", "global")
    assert np.array_equal(model.params, np.ones(4)) and model.momentum is None


def test_invalid_rounds_are_refused_with_reasons():
    store = AveragingStore()
    with pytest.raises(InvalidCollectiveError, match="no global model 'global' to apply"):
        store.open_round("job", spec(pb.AVERAGING_RULE_OUTER_NESTEROV, 0.7, 0.9), 3)
    run_round(store, pb.AVERAGING_RULE_SEED, np.ones(3, np.float32))
    with pytest.raises(InvalidCollectiveError, match="has 3 parameters, but this round sends 4"):
        store.open_round("job", spec(pb.AVERAGING_RULE_AVERAGE), 4)
    with pytest.raises(InvalidCollectiveError, match="unknown averaging rule 42"):
        store.open_round("job", spec(42), 3)
    with pytest.raises(InvalidCollectiveError, match="needs a model name"):
        store.open_round("job", spec(pb.AVERAGING_RULE_SEED, model=""), 3)


def test_models_are_per_job_and_per_name():
    store = AveragingStore()
    run_round(store, pb.AVERAGING_RULE_SEED, np.ones(2, np.float32), job="a")
    assert store.get("b", "global") is None
    assert store.get("a", "other") is None


def test_completed_rounds_survive_a_restart_of_the_store(tmp_path):
    store = AveragingStore(tmp_path)
    run_round(store, pb.AVERAGING_RULE_SEED, np.ones(4, np.float32), job="../escape")
    run_round(store, pb.AVERAGING_RULE_OUTER_NESTEROV, np.full(4, 0.5, np.float32), 0.7, 0.9,
              job="../escape")
    saved = store.get("../escape", "global")

    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) == 1 and files[0].suffix == ".npz"  # no temporary file left behind
    assert tmp_path in files[0].parents  # the job name cannot escape the state directory

    reloaded = AveragingStore(tmp_path).get("../escape", "global")
    assert reloaded.rounds == saved.rounds == 1
    np.testing.assert_array_equal(reloaded.params, saved.params)
    np.testing.assert_array_equal(reloaded.momentum, saved.momentum)
