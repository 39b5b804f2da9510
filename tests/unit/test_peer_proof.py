"""The peer hello's proof of identity, without sockets (gradstar.client.peer.proof), with the
per-pair keys the coordinator derives (gradstar.coordinator.rendezvous)."""

from __future__ import annotations

import hashlib
import hmac
import itertools

import pytest

from gradstar.client.peer import proof
from gradstar.coordinator.rendezvous import Generation, Job, pair_key
from gradstar.errors import AuthenticationError
from gradstar.proto.v1 import peer_pb2 as ppb

SECRET = bytes(range(32))
WORLD = 4


def keys_of(rank: int, secret: bytes = SECRET) -> list[bytes]:
    """Rank ``rank``'s ``Joined.peer_keys``, as the coordinator derives them."""
    return Generation(Job("j", WORLD), 3, WORLD, {}, peer_secret=secret).peer_keys(rank)


def hello(src: int = 0, dst: int = 1) -> ppb.PeerHello:
    return ppb.PeerHello(job="j", generation=3, src_rank=src, dst_rank=dst)


def signed(src: int = 0, dst: int = 1) -> ppb.PeerHello:
    return proof.sign(keys_of(src)[dst], hello(src, dst))


def verifier(rank: int = 1) -> proof.HelloVerifier:
    return proof.HelloVerifier(keys_of(rank))


def test_a_signed_hello_is_accepted_once_and_its_replay_refused():
    receiver = verifier()
    first = signed()
    receiver.verify(first)
    with pytest.raises(AuthenticationError, match="rank 0 was refused: its hello replays"):
        receiver.verify(first)


def test_every_hello_gets_a_fresh_nonce():
    assert signed().nonce != signed().nonce
    assert len(signed().nonce) == proof.NONCE_BYTES


@pytest.mark.parametrize("field, value", [("job", "k"), ("generation", 4), ("src_rank", 2),
                                          ("dst_rank", 2), ("nonce", bytes(16))])
def test_a_proof_covers_every_field_of_the_hello(field, value):
    altered = signed()
    setattr(altered, field, value)
    with pytest.raises(AuthenticationError, match=r"proof of being rank \d of generation \d+ is "
                                                  "wrong"):
        verifier().verify(altered)


def test_a_hello_without_proof_or_under_another_key_is_refused():
    with pytest.raises(AuthenticationError, match="carries no proof of being rank 0"):
        verifier().verify(hello())
    with pytest.raises(AuthenticationError, match="is wrong"):
        verifier().verify(proof.sign(bytes(32), hello()))


def test_a_rank_without_a_key_for_the_sender_refuses_its_hellos():
    with pytest.raises(AuthenticationError, match="no peer key for rank 0"):
        proof.HelloVerifier(()).verify(proof.sign(b"", hello()))
    # Nor does a claimed sender outside the key list get by (the rank's own index is empty).
    with pytest.raises(AuthenticationError, match="no peer key for rank 7"):
        verifier().verify(proof.sign(b"", hello(src=7)))
    with pytest.raises(AuthenticationError, match="no peer key for rank 1"):
        verifier().verify(proof.sign(b"", hello(src=1)))


def test_the_remembered_nonces_are_bounded(monkeypatch):
    monkeypatch.setattr(proof, "REMEMBERED_NONCES", 2)
    receiver = verifier()
    first = signed()
    for each in (first, signed(), signed()):
        receiver.verify(each)
    receiver.verify(first)  # forgotten: the oldest nonce left the bounded memory


# -- per-pair keys -----------------------------------------------------------------------------


def test_a_members_keys_verify_its_own_pairs_in_both_directions():
    for src, dst in itertools.permutations(range(WORLD), 2):
        verifier(dst).verify(signed(src, dst))


def test_a_member_cannot_sign_a_hello_as_another_member():
    # Rank r holds k(r, x) for every x; a hello from s to t (s, t != r) needs k(s, t).
    for r, s, t in itertools.permutations(range(WORLD), 3):
        for key in keys_of(r):
            forged = proof.sign(key, hello(src=s, dst=t))
            with pytest.raises(AuthenticationError,
                               match=f"claiming to come from rank {s} was refused: its proof "
                                     f"of being rank {s} of generation 3 is wrong"):
                verifier(t).verify(forged)


def test_a_hello_signed_for_one_receiver_is_void_at_another():
    # Rank 0's hello to rank 1, pointed at rank 2 instead (a member relaying what it received).
    relayed = signed(0, 1)
    relayed.dst_rank = 2
    with pytest.raises(AuthenticationError, match="is wrong"):
        verifier(2).verify(relayed)


def test_keys_differ_per_pair_and_per_secret_and_the_own_slot_is_empty():
    every = {keys_of(r)[x] for r, x in itertools.permutations(range(WORLD), 2)}
    assert len(every) == WORLD * (WORLD - 1) // 2  # one key per unordered pair, no repeats
    assert all(len(key) == 32 for key in every)
    assert [keys_of(r)[r] for r in range(WORLD)] == [b""] * WORLD
    other = {keys_of(r, bytes(32))[x] for r, x in itertools.permutations(range(WORLD), 2)}
    assert not every & other


def test_the_derivation_is_deterministic_symmetric_and_domain_separated():
    assert keys_of(2) == keys_of(2)
    for a, b in itertools.combinations(range(WORLD), 2):
        assert pair_key(SECRET, a, b) == pair_key(SECRET, b, a) == keys_of(a)[b] == keys_of(b)[a]
    # The encoding: a context string, then the lower and higher rank as big-endian uint32.
    expected = hmac.new(SECRET, b"gradstar peer pair key v1\x00" + bytes([0, 0, 0, 1, 0, 0, 1, 0]),
                        hashlib.sha256).digest()
    assert pair_key(SECRET, 256, 1) == expected


def test_a_generation_without_a_secret_hands_out_no_keys():
    # A hub shard's adopted copy: it never sends Joined, and an empty secret must not yield
    # keys anyone could compute.
    assert Generation(Job("j", WORLD), 3, WORLD, {}).peer_keys(0) == []
