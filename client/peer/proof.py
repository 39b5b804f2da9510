"""Proof of identity in a peer stream's hello (no I/O; the protocol is in
:mod:`gradstar.client.peer`).

The coordinator gives each member of a generation one key per other member
(``Joined.peer_keys``, by rank): the key of a pair of ranks is known to those two ranks and the
coordinator only. A sender ``s`` signs its hello to ``t`` with the key of (s, t); the receiver
``t`` checks the signature with its own key for the claimed sender, then that the nonce is new.
What this does and does not prevent is stated in the package docstring.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict
from collections.abc import Sequence

from gradstar.errors import AuthenticationError
from gradstar.proto.v1 import peer_pb2 as ppb

NONCE_BYTES = 16
#: Valid hellos whose nonces a receiver remembers. A generation opens at most one stream per
#: sender to a receiver, so this is far above what members need; it only bounds the memory a
#: misbehaving member can make a receiver spend.
REMEMBERED_NONCES = 4096
# Domain separation: a proof of a peer hello can never be mistaken for another use of a key.
_CONTEXT = b"gradstar peer hello v1\x00"


def _signed_bytes(hello: ppb.PeerHello) -> bytes:
    job = hello.job.encode()
    # Length-prefixed, so no two (job, generation, ranks, nonce) encode to the same bytes.
    return b"%s%d:%s|%d|%d|%d|%s" % (_CONTEXT, len(job), job, hello.generation,
                                     hello.src_rank, hello.dst_rank, hello.nonce)


def _proof(key: bytes, hello: ppb.PeerHello) -> bytes:
    return hmac.new(key, _signed_bytes(hello), hashlib.sha256).digest()


def sign(key: bytes, hello: ppb.PeerHello) -> ppb.PeerHello:
    """Give ``hello`` a fresh nonce and its proof under ``key``, the key the sender shares with
    the receiver; return it."""
    hello.nonce = secrets.token_bytes(NONCE_BYTES)
    hello.proof = _proof(key, hello)
    return hello


class HelloVerifier:
    """A receiver's check of incoming hellos for one generation: the proof, then the nonce.

    ``keys`` are this rank's ``Joined.peer_keys``: by rank, the key it shares with that rank.
    Call :meth:`verify` only once the hello's job, generation and receiver are known to be
    this rank's, so the proof is all that is left to decide.
    """

    def __init__(self, keys: Sequence[bytes]) -> None:
        self._keys = tuple(keys)
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def verify(self, hello: ppb.PeerHello) -> None:
        """Accept ``hello`` or raise.

        Raises:
            AuthenticationError: this rank got no key for the claimed sender, the proof is
                missing or wrong (signed by another rank than the one it claims to come
                from, for one), or the nonce was used before (a replayed hello); the message
                names the claimed rank.
        """
        src = hello.src_rank
        claimed = f"a peer stream claiming to come from rank {src}"
        key = self._keys[src] if 0 <= src < len(self._keys) else b""
        if not key:
            raise AuthenticationError(
                f"{claimed} was refused: the coordinator gave this rank no peer key for rank "
                f"{src}, so it cannot check who is sending")
        if len(hello.nonce) != NONCE_BYTES or not hello.proof:
            raise AuthenticationError(
                f"{claimed} was refused: its hello carries no proof of being rank {src} of "
                f"generation {hello.generation}")
        if not hmac.compare_digest(hello.proof, _proof(key, hello)):
            raise AuthenticationError(
                f"{claimed} was refused: its proof of being rank {src} of generation "
                f"{hello.generation} is wrong")
        if hello.nonce in self._seen:
            raise AuthenticationError(
                f"{claimed} was refused: its hello replays one this rank already accepted")
        self._seen[hello.nonce] = None
        if len(self._seen) > REMEMBERED_NONCES:
            self._seen.popitem(last=False)
