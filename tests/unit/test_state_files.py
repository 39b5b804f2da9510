"""State file names: any job or model name stays inside the state directory, and no two collide."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from gradstar.coordinator.rounds import AveragingStore, state_file_stem
from gradstar.proto.v1 import collective_pb2 as pb

HOSTILE = ["..", ".", "", "a/b", "../../etc", "/etc/passwd", "a\\b", "x\x00y", "~", "%2E%2E",
           ".hidden", "-rf", "é/ü", "\udcff", "n" * (10 << 20), "n" * (10 << 20) + "!"]


@pytest.mark.parametrize("name", HOSTILE, ids=lambda n: repr(n[:12]))
def test_a_stem_is_one_plain_path_component(name):
    stem = state_file_stem(name)
    assert stem.isascii() and stem.isprintable()
    assert not set(stem) & {"/", "\\", "\x00", "."}
    assert len(stem) <= 141
    assert stem == state_file_stem(name)  # the same name finds its file again


def test_a_stem_keeps_a_readable_prefix():
    assert state_file_stem("demo-job_1").startswith("demo-job_1-")
    assert state_file_stem("../etc").startswith("%2E%2E%2Fetc-")


def test_different_names_never_share_a_stem():
    # Names equal after escaping or truncation, and names that look like another's escape.
    names = [*HOSTILE, "%2E", "%", "a%2Fb", "A", "a", "n" * 40, "n" * 41, "n" * 40 + "m"]
    assert len({state_file_stem(n) for n in names}) == len(set(names))


def seed(store: AveragingStore, job: str, model: str, values: np.ndarray) -> None:
    spec = pb.AveragingSpec(model=model, rule=pb.AVERAGING_RULE_SEED)
    rnd = store.open_round(job, spec, values.shape[0])
    rnd.apply(0, values.copy())
    rnd.commit()


def test_hostile_names_land_inside_the_state_dir_and_survive_a_restart(tmp_path):
    state = tmp_path / "state"
    names = ["..", ".", "a/b", "../../etc", "x\x00y", "n" * (10 << 20)]
    pairs = list(itertools.product(names, ["..", "global", "m/../../x"]))
    store = AveragingStore(state)
    for i, (job, model) in enumerate(pairs):
        seed(store, job, model, np.full(3, i, np.float32))

    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) == len(pairs)  # one each: no collision, no temporary file left behind
    for path in files:
        assert path.resolve().parent.parent == state.resolve()
        assert path.suffix == ".npz"

    reloaded = AveragingStore(state)
    for i, (job, model) in enumerate(pairs):
        np.testing.assert_array_equal(reloaded.get(job, model).params, np.full(3, i, np.float32))
    assert reloaded.get("..", "other") is None
