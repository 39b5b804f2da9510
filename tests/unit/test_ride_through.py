"""Riding through a coordinator restart without sockets: the coordinator's rebuild of a
generation from its ranks' claims (coordinator/rendezvous/rebuild.py) and the rank's record of
the collectives it may issue again (client/collective/reissue.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from gradstar import ops
from gradstar.client.collective.reissue import Reissue, Seqs
from gradstar.coordinator.rendezvous import Rendezvous
from gradstar.coordinator.rendezvous.rebuild import Claim, Rebuild, check_claim, gather
from gradstar.errors import JoinTimeoutError, RejoinRefusedError
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.proto.v1 import rendezvous_pb2 as rpb


def claim(rank: int, *, generation: int = 3, world_size: int = 2, next_seq: int = 10,
          pending=(9,), retained=(8,), job: str = "j") -> Claim:
    return Claim(job, world_size, rank, generation, f"member-{rank}", next_seq,
                 frozenset(pending), frozenset(retained), f"10.0.0.{rank}:7000")


async def test_a_generation_is_rebuilt_once_every_rank_rejoined():
    formed = []
    rendezvous = Rendezvous(heartbeat_timeout=30, on_generation_formed=formed.append)
    first = asyncio.ensure_future(rendezvous.rebuilds.rejoin(claim(0), timeout=5))
    await asyncio.sleep(0)
    assert not first.done() and "j" not in rendezvous.jobs  # waits for rank 1
    (m1, replay1), (m0, replay0) = await asyncio.gather(
        rendezvous.rebuilds.rejoin(claim(1, pending=(), retained=(9,)), timeout=5), first)
    gen = rendezvous.jobs["j"].generation
    assert formed == [gen] and gen.number == 3 and gen.world_size == 2 and gen.healthy
    assert (m0.member_id, m1.member_id) == ("member-0", "member-1")
    assert gen.members[1].peer_address == "10.0.0.1:7000" and m0.generation is gen
    assert replay0 == replay1 == [9]  # rank 0 waited for 9; rank 1 issues it again
    # The collectives of the rebuilt generation are bound to the same members as before.
    assert rendezvous.member("j", 3, 0, "member-0") is gen
    # A new generation forms after it as after any other (numbers go on from 3).
    assert rendezvous.jobs["j"].generations_formed == 3


@pytest.mark.parametrize(("bad", "says"), [
    (dict(generation=0), "no generation of that number"),
    (dict(next_seq=9, pending=(9,)), "cannot be"),
    (dict(pending=(8,), retained=(8,)), "cannot be"),
    (dict(next_seq=0, pending=(), retained=()), "cannot be"),
])
def test_a_claim_that_cannot_be_is_refused_on_its_own(bad, says):
    with pytest.raises(RejoinRefusedError, match=says):
        check_claim(claim(0, **bad), None)


async def test_a_coordinator_that_holds_the_job_refuses_to_take_it_back():
    rendezvous = Rendezvous(heartbeat_timeout=30)
    members = await asyncio.gather(*(rendezvous.join("j", 2, r, "", 5) for r in range(2)))
    number = members[0].generation.number
    for generation in (number, number - 1 if number > 1 else number):
        with pytest.raises(RejoinRefusedError, match="holds the job at generation 1"):
            await rendezvous.rebuilds.rejoin(claim(0, generation=generation), timeout=1)
    assert rendezvous.jobs["j"].generation.healthy  # a refusal changes nothing


async def test_claims_that_disagree_fail_the_whole_rebuild():
    rebuild = Rebuild("j", 3, 2)
    gather(rebuild, claim(0))
    with pytest.raises(RejoinRefusedError, match="generation 4 of 2 ranks"):
        gather(rebuild, claim(1, generation=4))
    with pytest.raises(RejoinRefusedError):
        rebuild.done.result()  # every rank waiting on it is refused too
    for other in (Claim("j", 2, 0, 3, "someone-else", 10), Claim("j", 2, 1, 3, "member-0", 10)):
        rebuild = Rebuild("j", 3, 2)
        gather(rebuild, claim(0))
        with pytest.raises(RejoinRefusedError, match="member id"):
            gather(rebuild, other)
    rebuild = Rebuild("j", 3, 2)
    gather(rebuild, claim(0))
    gather(rebuild, claim(0, next_seq=11, pending=(9, 10)))  # the same member retrying
    assert rebuild.claims[0].next_seq == 11 and rebuild.missing == [1]


async def test_a_seq_one_rank_waits_for_and_another_dropped_is_refused_by_name():
    rendezvous = Rendezvous(heartbeat_timeout=30)
    waiting = asyncio.ensure_future(rendezvous.rebuilds.rejoin(claim(0), timeout=5))
    await asyncio.sleep(0)
    with pytest.raises(RejoinRefusedError, match=r"rank 1 .* completed collective seq 9, which "
                                                 r"rank 0 had not seen complete"):
        await rendezvous.rebuilds.rejoin(claim(1, pending=(12,), retained=(11,), next_seq=13),
                                         timeout=5)
    with pytest.raises(RejoinRefusedError):
        await waiting
    assert "j" not in rendezvous.jobs


async def test_a_rebuild_times_out_naming_the_ranks_that_did_not_rejoin():
    rendezvous = Rendezvous(heartbeat_timeout=30)
    with pytest.raises(JoinTimeoutError, match=r"ranks \[1, 2\] of generation 3"):
        await rendezvous.rebuilds.rejoin(claim(0, world_size=3), timeout=0.05)


def call(seq: int) -> ops.CollectiveCall:
    header = pb.CollectiveHeader(job="j", generation=1, group="default", seq=seq, rank=0,
                                 op=ops.ALL_REDUCE, reduce_op=1, dtype=1, shape=[4],
                                 chunk_bytes=1 << 20)
    return ops.CollectiveCall.of(header, 2)


def test_inputs_are_copied_and_completed_collectives_kept_until_a_later_one_completes():
    seqs = Seqs()
    reissue = Reissue(seqs)
    assert [next(seqs) for _ in range(3)] == [1, 2, 3] and seqs.next == 4
    x = np.arange(4, dtype=np.float32)
    # Step 1: two buckets in flight at once; step 2: one, issued after both completed.
    a, b = (reissue.hold(call(s), x, x, None) for s in (1, 2))
    x[:] = -1  # an in-place result arriving: the copies keep the input
    assert np.array_equal(a.send, np.arange(4)) and a.send is not x
    reissue.completed(b)
    reissue.completed(a)
    c = reissue.hold(call(3), x, x, None)
    joined = rpb.Joined(generation=1, member_id="m")
    claimed = reissue.claim(joined)
    assert (list(claimed.pending), list(claimed.retained), claimed.next_seq) == ([3], [1, 2], 4)
    assert reissue.held_bytes == 3 * x.nbytes
    reissue.completed(c)  # proves every rank issued 3, hence completed 1 and 2
    assert sorted(reissue.retained) == [3] and not reissue.pending
    # Two issued at once: each one's completion proves 3's, not the other's.
    d, e = (reissue.hold(call(s), x, x, None) for s in (next(seqs), next(seqs)))
    reissue.completed(d)
    reissue.completed(e)
    assert sorted(reissue.retained) == [4, 5]
    reissue.dropped(reissue.hold(call(next(seqs)), None, x, None))
    assert reissue.claim(joined).next_seq == 7 and not reissue.pending
    # Not in place: the input itself is sent again (no copy), and not kept once completed.
    y = np.ones(4, np.float32)
    f = reissue.hold(call(next(seqs)), y, np.empty_like(y), None)
    assert f.send is y and not f.owned and reissue.held_bytes == 2 * x.nbytes
    reissue.completed(f)
    assert 8 not in reissue.retained and not reissue.pending


def test_an_outer_round_issued_again_after_a_restart_is_applied_once(tmp_path):
    from gradstar.coordinator.rounds.averaging import AveragingStore, GlobalModel

    spec = pb.AveragingSpec(model="m", rule=pb.AVERAGING_RULE_OUTER_SGD, outer_lr=0.5)
    store = AveragingStore(tmp_path)
    store.install(("j", "m"), GlobalModel(np.zeros(4, np.float32), None, 0))
    step = store.open_round("j", spec, 4, made_by="1/7/abc")
    mean = np.ones(4, np.float32)
    step.apply(0, mean)
    step.commit()  # persisted; say the coordinator died before any rank got its END
    restarted = AveragingStore(tmp_path)
    again = restarted.open_round("j", spec, 4, made_by="1/7/abc")
    mean = np.ones(4, np.float32)
    again.apply(0, mean)
    assert np.array_equal(mean, np.full(4, -0.5, np.float32))  # the step taken once
    assert again.commit().rounds == 1
    # Another collective (the next seq, or the same seq of a generation formed anew) steps.
    for made_by in ("1/8/abc", "1/7/other-members"):
        fresh = restarted.open_round("j", spec, 4, made_by=made_by)
        mean = np.ones(4, np.float32)
        fresh.apply(0, mean)
        assert np.array_equal(mean, np.full(4, -1.0, np.float32))
