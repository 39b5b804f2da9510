"""What a wrapper needs of a process group is a Protocol
(gradstar.client.process_group.protocol): the blocking ProcessGroup is one, the
AsyncProcessGroup is not, and every wrapper refuses a group that lacks a member, by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

import gradstar
from gradstar.client.ddp.elastic import ElasticSteps, ModuleState
from gradstar.client.process_group import AsyncProcessGroup, ProcessGroup
from gradstar.client.process_group.protocol import (
    BackendGroup,
    CollectiveGroup,
    ElasticGroup,
    PeerGroup,
)
from gradstar.config import ClientSettings
from gradstar.errors import ConfigurationError


def blocking_group() -> ProcessGroup:
    """A blocking ProcessGroup over a stand-in for its asyncio group (no connection)."""
    inner = SimpleNamespace(rank=0, world_size=2, job="j", settings=ClientSettings(),
                            joined=SimpleNamespace(newcomers=[]), membership=None)
    return ProcessGroup(inner, runner=None)


def test_the_blocking_group_is_what_wrappers_and_the_backend_need():
    pg = blocking_group()
    assert isinstance(pg, CollectiveGroup) and isinstance(pg, BackendGroup)
    assert isinstance(pg, PeerGroup) and isinstance(pg, ElasticGroup)


def test_the_asyncio_group_is_not_a_wrappers_group():
    # Its calls are awaited on the caller's loop: it has no loop of its own to submit to.
    missing = {"submit", "on_close"} - set(dir(AsyncProcessGroup))
    assert missing == {"submit", "on_close"}


class WithoutSubmit:
    """Every member of a CollectiveGroup but ``submit``."""

    rank, world_size = 0, 2

    def __getattr__(self, name):
        if name == "submit":
            raise AttributeError(name)
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("wrap", [
    lambda pg: gradstar.DDP(nn.Linear(2, 2), pg),
    lambda pg: gradstar.FSDP(nn.Linear(2, 2), pg),
    lambda pg: gradstar.Pipeline(nn.Linear(2, 2), pg, num_microbatches=2),
], ids=["DDP", "FSDP", "Pipeline"])
def test_every_wrapper_refuses_a_group_that_lacks_a_member(wrap):
    assert isinstance(blocking_group(), CollectiveGroup)
    assert not isinstance(WithoutSubmit(), CollectiveGroup)
    with pytest.raises(ConfigurationError, match=r"needs the blocking .*ProcessGroup"):
        wrap(WithoutSubmit())


class CollectivesOnly:
    """A wrapper's group (every member of a CollectiveGroup) that cannot move at boundaries."""

    rank, world_size = 0, 2

    def __getattr__(self, name):
        if name in {"step_boundary", "move_at_boundaries", "newcomer", "departed", "depart"}:
            raise AttributeError(name)
        return lambda *args, **kwargs: None


def test_a_synchronous_ddp_crosses_step_boundaries_only_over_an_elastic_group():
    assert isinstance(CollectivesOnly(), CollectiveGroup)
    assert not isinstance(CollectivesOnly(), ElasticGroup)
    module = nn.Linear(2, 2)
    assert not ElasticSteps(CollectivesOnly(), ModuleState(module, None),
                            synchronous=True).enabled
    moved = []
    group = SimpleNamespace(**{name: (lambda *a, **k: None) for name in (
        "all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier", "send", "recv",
        "submit", "on_close", "step_boundary", "depart", "close")}, rank=0, world_size=2,
        newcomer=False, departed=False, move_at_boundaries=moved.append)
    assert isinstance(group, ElasticGroup)
    state = ModuleState(module, None)
    steps = ElasticSteps(group, state, synchronous=True)
    steps.declare()
    assert steps.enabled and moved == [True]
    # A sync-mode DDP says so too: a joiner past the world size waits for every rank's word.
    steps = ElasticSteps(group, state, synchronous=False)
    steps.declare()
    assert not steps.enabled and moved == [True, False]
    ElasticSteps(CollectivesOnly(), state, synchronous=True).declare()  # says nothing
    assert moved == [True, False]


def test_settled_runs_only_this_groups_own_collectives():
    # torch's waited calls name the collective by the method itself (pg.all_reduce), not by
    # a string: anything else is refused before anything is sent.
    pg, other = blocking_group(), blocking_group()
    for method in (print, other.all_reduce, pg.close, ProcessGroup.all_reduce):
        with pytest.raises(ConfigurationError, match=r"settled\(\) runs one of this group's "
                                                     r"collectives \(pg.all_reduce"):
            pg.settled(method, [1.0])
