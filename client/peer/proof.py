"""Proof of membership in a peer stream's hello (no I/O; the protocol is in
:mod:`gradstar.client.peer`).

The coordinator gives every member of a generation the same random key
(``Joined.peer_key``). A sender signs its hello with it; the receiver checks the signature and
that the nonce is new. What this does and does not prevent is stated in the package docstring.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict

from gradstar.errors import AuthenticationError
from gradstar.proto.v1 import peer_pb2 as ppb

NONCE_BYTES = 16
#: Valid hellos whose nonces a receiver remembers. A generation opens at most one stream per
#: sender to a receiver, so this is far above what members need; it only bounds the memory a
#: misbehaving member can make a receiver spend.
REMEMBERED_NONCES = 4096
# Domain separation: a proof of a peer hello can never be mistaken for another use of the key.
_CONTEXT = b"gradstar peer hello v1\x00"


def _signed_bytes(hello: ppb.PeerHello) -> bytes:
    job = hello.job.encode()
    # Length-prefixed, so no two (job, generation, ranks, nonce) encode to the same bytes.
    return b"%s%d:%s|%d|%d|%d|%s" % (_CONTEXT, len(job), job, hello.generation,
                                     hello.src_rank, hello.dst_rank, hello.nonce)


def _proof(key: bytes, hello: ppb.PeerHello) -> bytes:
    return hmac.new(key, _signed_bytes(hello), hashlib.sha256).digest()


def sign(key: bytes, hello: ppb.PeerHello) -> ppb.PeerHello:
    """Give ``hello`` a fresh nonce and its proof under the generation's ``key``; return it."""
    hello.nonce = secrets.token_bytes(NONCE_BYTES)
    hello.proof = _proof(key, hello)
    return hello


class HelloVerifier:
    """A receiver's check of incoming hellos for one generation: the proof, then the nonce.

    Call :meth:`verify` only once the hello's job, generation and receiver are known to be
    this rank's, so the proof is all that is left to decide.
    """

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def verify(self, hello: ppb.PeerHello) -> None:
        """Accept ``hello`` or raise.

        Raises:
            AuthenticationError: this rank got no key, the proof is missing or wrong, or the
                nonce was used before (a replayed hello); the message names the claimed rank.
        """
        claimed = f"a peer stream claiming to come from rank {hello.src_rank}"
        if not self._key:
            raise AuthenticationError(
                f"{claimed} was refused: the coordinator gave this rank no peer key, so it "
                "cannot check who is sending")
        if len(hello.nonce) != NONCE_BYTES or not hello.proof:
            raise AuthenticationError(
                f"{claimed} was refused: its hello carries no proof of membership in "
                f"generation {hello.generation}")
        if not hmac.compare_digest(hello.proof, _proof(self._key, hello)):
            raise AuthenticationError(
                f"{claimed} was refused: its proof of membership in generation "
                f"{hello.generation} is wrong")
        if hello.nonce in self._seen:
            raise AuthenticationError(
                f"{claimed} was refused: its hello replays one this rank already accepted")
        self._seen[hello.nonce] = None
        if len(self._seen) > REMEMBERED_NONCES:
            self._seen.popitem(last=False)
