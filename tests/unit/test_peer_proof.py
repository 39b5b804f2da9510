"""The peer hello's proof of membership, without sockets (gradstar.client.peer.proof)."""

from __future__ import annotations

import pytest

from gradstar.client.peer import proof
from gradstar.errors import AuthenticationError
from gradstar.proto.v1 import peer_pb2 as ppb

KEY = bytes(range(32))


def signed() -> ppb.PeerHello:
    return proof.sign(KEY, ppb.PeerHello(job="j", generation=3, src_rank=0, dst_rank=1))


def test_a_signed_hello_is_accepted_once_and_its_replay_refused():
    verifier = proof.HelloVerifier(KEY)
    hello = signed()
    verifier.verify(hello)
    with pytest.raises(AuthenticationError, match="rank 0 was refused: its hello replays"):
        verifier.verify(hello)


def test_every_hello_gets_a_fresh_nonce():
    assert signed().nonce != signed().nonce
    assert len(signed().nonce) == proof.NONCE_BYTES


@pytest.mark.parametrize("field, value", [("job", "k"), ("generation", 4), ("src_rank", 2),
                                          ("dst_rank", 2), ("nonce", bytes(16))])
def test_a_proof_covers_every_field_of_the_hello(field, value):
    hello = signed()
    setattr(hello, field, value)
    with pytest.raises(AuthenticationError, match=r"proof of membership .* is wrong"):
        proof.HelloVerifier(KEY).verify(hello)


def test_a_hello_without_proof_or_under_another_key_is_refused():
    unsigned = ppb.PeerHello(job="j", generation=3, src_rank=0, dst_rank=1)
    with pytest.raises(AuthenticationError, match="carries no proof"):
        proof.HelloVerifier(KEY).verify(unsigned)
    with pytest.raises(AuthenticationError, match="is wrong"):
        proof.HelloVerifier(KEY).verify(proof.sign(bytes(32), unsigned))


def test_a_rank_without_a_key_refuses_every_hello():
    with pytest.raises(AuthenticationError, match="no peer key"):
        proof.HelloVerifier(b"").verify(proof.sign(b"", ppb.PeerHello(job="j")))


def test_the_remembered_nonces_are_bounded(monkeypatch):
    monkeypatch.setattr(proof, "REMEMBERED_NONCES", 2)
    verifier = proof.HelloVerifier(KEY)
    first = signed()
    for hello in (first, signed(), signed()):
        verifier.verify(hello)
    verifier.verify(first)  # forgotten: the oldest nonce left the bounded memory
