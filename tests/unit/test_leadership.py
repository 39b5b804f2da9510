"""Coordinators under --ha, without sockets: the etcd URL, the rank's list of coordinators
and the term it holds, and the state directory's guard. The election against a real etcd is
tests/integration/test_standby.py."""

from __future__ import annotations

import numpy as np
import pytest

from gradstar.client.coordinators import Coordinators, addresses_of
from gradstar.config import ClientSettings
from gradstar.coordinator.leadership import endpoints_of
from gradstar.coordinator.rounds.averaging import save_arrays
from gradstar.errors import ConfigurationError, NotLeaderError, StaleCoordinatorError
from gradstar.proto.v1 import rendezvous_pb2 as rpb


def test_an_etcd_url_names_its_endpoints_and_prefix():
    assert endpoints_of("etcd://10.0.0.1:2379") == (["10.0.0.1:2379"], "/gradstar")
    assert endpoints_of("etcd://a:1,b:2/jobs/x/") == (["a:1", "b:2"], "/jobs/x")


@pytest.mark.parametrize("url", ["http://a:2379", "etcd://", "etcd://a", "etcd://a:x"])
def test_a_bad_etcd_url_is_refused_by_name(url):
    with pytest.raises(ConfigurationError, match="--ha"):
        endpoints_of(url)


def test_a_coordinator_setting_lists_addresses_in_order():
    assert addresses_of("a:1") == ["a:1"]
    assert addresses_of(" a:1, b:2 ,") == ["a:1", "b:2"]
    for bad in ("", " , ", "a:1,a:1"):
        with pytest.raises(ConfigurationError):
            addresses_of(bad)


def test_the_next_coordinator_is_the_leader_named_else_the_next_in_the_list():
    coordinators = Coordinators(ClientSettings(coordinator="a:1,b:2,c:3", world_size=1))
    assert coordinators.several and coordinators.current == "a:1"
    assert coordinators.after("a:1") == "b:2"
    assert coordinators.after("c:3") == "a:1"
    assert coordinators.after("a:1", leader="c:3") == "c:3"
    assert coordinators.after("b:2", leader="elsewhere:9") == "c:3"  # not one of ours
    assert coordinators.after("b:2", leader="b:2") == "c:3"


def test_a_rank_refuses_a_coordinator_of_an_older_term():
    coordinators = Coordinators(ClientSettings(coordinator="a:1,b:2", world_size=1))
    coordinators.accept(rpb.Joined(term=7), "b:2")
    assert (coordinators.term, coordinators.current) == (7, "b:2")
    with pytest.raises(StaleCoordinatorError, match=r"term 5.*leader of term 7") as stale:
        coordinators.accept(rpb.Joined(term=5), "a:1")
    assert (stale.value.term, stale.value.seen) == (5, 7)
    assert (coordinators.term, coordinators.current) == (7, "b:2")  # nothing of it taken
    coordinators.accept(rpb.Joined(term=9), "a:1")
    assert (coordinators.term, coordinators.current) == (9, "a:1")


def test_a_coordinator_that_does_not_lead_never_replaces_a_state_file(tmp_path):
    path = tmp_path / "job" / "model.npz"
    save_arrays(path, {"x": np.ones(3)})

    def refuse():
        raise NotLeaderError("the coordinator at a:1 is fenced and serves no job")

    with pytest.raises(NotLeaderError):
        save_arrays(path, {"x": np.zeros(3)}, refuse)
    with np.load(path) as data:
        assert data["x"].tolist() == [1.0, 1.0, 1.0]
    assert [p.name for p in path.parent.iterdir()] == ["model.npz"]  # no temporary left
