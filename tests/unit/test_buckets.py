"""BucketPlan: reverse order, the byte cap, oversized tensors, dtype grouping (no sockets)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradstar.client.buckets import BucketPlan, TensorSpec, cap_bytes_of
from gradstar.errors import ConfigurationError


def f32(numel: int) -> TensorSpec:
    return TensorSpec(numel, 4, "float32")


def members(plan: BucketPlan) -> list[tuple[int, ...]]:
    return [b.members for b in plan]


def test_tensors_go_in_reverse_registration_order():
    plan = BucketPlan([f32(3), f32(5), f32(2)], cap_bytes=1 << 20)

    assert members(plan) == [(2, 1, 0)]
    bucket = plan[0]
    assert bucket.offsets == (0, 2, 7)
    assert bucket.numels == (2, 5, 3)
    assert (bucket.numel, bucket.nbytes) == (10, 40)
    assert plan.location == {2: (0, 0), 1: (0, 1), 0: (0, 2)}


def test_forward_order_when_not_reversed():
    plan = BucketPlan([f32(3), f32(5), f32(2)], cap_bytes=1 << 20, reverse=False)

    assert members(plan) == [(0, 1, 2)]
    assert plan[0].offsets == (0, 3, 8)


def test_a_bucket_closes_before_the_tensor_that_would_overflow_the_cap():
    # 36 B cap, walked backwards: 8 B + 16 B fit (24 B); the next 16 B would make 40 B.
    plan = BucketPlan([f32(4), f32(4), f32(4), f32(2)], cap_bytes=36)

    assert members(plan) == [(3, 2), (1, 0)]
    assert [b.nbytes for b in plan] == [24, 32]


def test_a_bucket_may_fill_the_cap_exactly():
    plan = BucketPlan([f32(5), f32(5), f32(5)], cap_bytes=40)

    assert members(plan) == [(2, 1), (0,)]
    assert plan[0].nbytes == 40


def test_a_tensor_larger_than_the_cap_gets_its_own_bucket():
    plan = BucketPlan([f32(1), f32(100), f32(1), f32(1)], cap_bytes=16)

    assert members(plan) == [(3, 2), (1,), (0,)]
    assert plan[1].nbytes == 400


def test_dtypes_never_share_a_bucket_and_buckets_follow_their_first_tensor():
    specs = [TensorSpec(2, 4, "float32"), TensorSpec(2, 2, "float16"),
             TensorSpec(2, 4, "float32"), TensorSpec(2, 2, "float16")]
    plan = BucketPlan(specs, cap_bytes=1 << 20)

    # Walked backwards: tensor 3 (float16) opens the first bucket, tensor 2 (float32) the second.
    assert members(plan) == [(3, 1), (2, 0)]
    assert [b.dtype for b in plan] == ["float16", "float32"]
    assert [b.nbytes for b in plan] == [8, 16]


def test_each_dtype_fills_its_own_open_bucket_under_the_cap():
    specs = [TensorSpec(4, 4, "f32"), TensorSpec(4, 8, "f64"), TensorSpec(4, 4, "f32"),
             TensorSpec(4, 8, "f64"), TensorSpec(4, 4, "f32")]
    plan = BucketPlan(specs, cap_bytes=32)

    assert members(plan) == [(4, 2), (3,), (1,), (0,)]
    assert [b.dtype for b in plan] == ["f32", "f64", "f64", "f32"]


def test_no_tensors_no_buckets():
    assert len(BucketPlan([], cap_bytes=8)) == 0


@pytest.mark.parametrize("cap", [0, -1])
def test_the_cap_must_be_positive(cap):
    with pytest.raises(ConfigurationError, match="the bucket cap must be positive"):
        BucketPlan([f32(1)], cap_bytes=cap)


def test_cap_bytes_of_uses_mebibytes_like_torch():
    assert cap_bytes_of(25) == 25 * 2**20
    assert cap_bytes_of(0.5) == 2**19
    assert cap_bytes_of(1e-9) == 1


@pytest.mark.parametrize("bad", [0, -3, math.nan, "25", None, True])
def test_cap_bytes_of_rejects_what_is_not_a_positive_number(bad):
    with pytest.raises(ConfigurationError, match="bucket_cap_mb must be a positive number"):
        cap_bytes_of(bad)


specs_strategy = st.lists(
    st.builds(lambda n, d: TensorSpec(n, {"a": 4, "b": 2, "c": 8}[d], d),
              st.integers(0, 300), st.sampled_from("abc")),
    max_size=30,
)


@given(specs=specs_strategy, cap=st.integers(1, 2000), reverse=st.booleans())
def test_plan_invariants(specs, cap, reverse):
    plan = BucketPlan(specs, cap, reverse=reverse)
    walk = list(range(len(specs)))[::-1] if reverse else list(range(len(specs)))
    position = {i: k for k, i in enumerate(walk)}

    # Every tensor is in exactly one bucket, at the location the plan reports.
    placed = [i for b in plan for i in b.members]
    assert sorted(placed) == list(range(len(specs)))
    for b in plan:
        assert b.index == plan.buckets.index(b)
        # One dtype per bucket, members in walk order, packed offsets.
        assert {specs[i].dtype for i in b.members} == {b.dtype}
        assert [position[i] for i in b.members] == sorted(position[i] for i in b.members)
        assert list(b.offsets) == [sum(b.numels[:k]) for k in range(len(b.members))]
        assert b.numel == sum(specs[i].numel for i in b.members)
        # The cap holds unless a single tensor exceeds it alone.
        assert b.nbytes <= cap or len(b.members) == 1
        for k, i in enumerate(b.members):
            assert plan.location[i] == (b.index, k)
    # Buckets are numbered by their first tensor in the walk.
    firsts = [position[b.members[0]] for b in plan]
    assert firsts == sorted(firsts)
    # Greedy: a bucket was only closed because the next tensor of its dtype did not fit.
    by_dtype: dict = {}
    for b in plan:
        by_dtype.setdefault(b.dtype, []).append(b)
    for buckets in by_dtype.values():
        for closed, following in itertools.pairwise(buckets):
            nxt = specs[following.members[0]]
            assert closed.nbytes + nxt.numel * nxt.itemsize > cap
