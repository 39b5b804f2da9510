"""Rank-to-rank streams: the peer server every rank runs, and its outgoing links.

The protocol (frames in ``protos/gradstar/proto/v1/peer.proto``):

* Every rank starts a :class:`~gradstar.client.peer.server.PeerServer` before it joins
  (``peer_host``:``peer_port``, port 0 by default) and registers its address at rendezvous;
  ``Joined.peers`` tells every rank where the others are.
* The first ``send`` to a rank opens ONE long-lived bidirectional stream to it (a
  :class:`PeerLink`): a hello naming job, generation, sender and receiver and proving that
  the sender is a member of the generation, answered by an accept once the receiver has
  checked them. Every later message to that rank rides the same
  stream: a header (seq, tag, dtype, shape, chunking), chunk frames with CRC-32s (the collective
  codec of :mod:`gradstar.wire`) and an end marker with the chunk and byte count. The receiver
  acknowledges each complete message by its seq; ``send`` completes with that acknowledgement,
  so a completed send is held by the receiver.
* The receiver files each message in the :class:`~gradstar.client.peer.mailbox.Mailbox` of its
  sender, where ``recv(src, tag)`` matches it by tag. Early messages are buffered up to
  ``peer_buffer_messages`` / ``peer_buffer_bytes`` per sender; past that the server stops
  reading the stream and flow control holds the sender back.
* ``recv(src=None)`` takes the next message with its tag from any sender
  (:class:`~gradstar.client.peer.mailbox.Mailboxes`): each sender's messages in the order it
  sent them, and across senders the one that arrived first.
* A rank closing its process group has *finished*. It lets its sends in flight finish, then ends
  each of its streams with a goodbye (an empty end marker) behind its last message, so its
  receivers can tell an orderly close from a broken stream, and answers the senders of its
  incoming streams with a ``RankFinishedError`` frame; only then does it leave the hub, whose
  notice tells the ranks it never opened a stream to. A receive from a finished rank gets what
  it sent, then raises :class:`~gradstar.errors.RankFinishedError` naming it at once (a
  receive from any sender: once every other rank finished); so does a send to it. A rank that
  closes its group after its generation failed has not finished: no goodbye, and its incoming
  streams are answered with the failure (a goodbye could overtake the hub's failure notice and
  make a neighbour report it finished instead of naming the lost rank).
* Failure: channels use the hub's keepalive options (a dead or frozen peer breaks its streams
  in seconds), and every wait also watches the rank's session with the hub, whose
  generation-failure notice names the lost rank. A broken stream waits briefly for that notice
  and raises it; without one it raises :class:`~gradstar.errors.RankLostError` naming the peer.
  Every wait is bounded by the operation's timeout
  (:class:`~gradstar.errors.CollectiveTimeoutError` naming the peer).
* Security: the job token travels in call metadata and the peer server checks it with the
  hub's interceptor. With ``tls_cert`` and ``tls_key`` the peer server serves TLS with them
  (requiring client certificates from ``tls_ca`` when set), and links use the same credentials
  as the hub's channel. A link whose TLS settings do not match its peer's (a certificate from
  another CA or for another name, a missing client certificate, TLS on one side only) fails
  within a second or two with :class:`~gradstar.errors.ConfigurationError` naming the cause
  (:mod:`gradstar.transport.tls_check`), not as a lost rank after ``connect_timeout``.
* Rank identity (:mod:`.proof`): the token only says "some process of this job". When a
  generation forms, the coordinator draws a random 32-byte secret for it, which never leaves
  the coordinator. From it each pair of ranks gets a key of its own,
  ``k(a, b) = HMAC-SHA256(secret, "gradstar peer pair key v1" | min(a, b) | max(a, b))``, and
  each member ``r`` gets its keys only (``Joined.peer_keys``: ``k(r, x)`` at index ``x``, 32
  bytes per rank) on its own session stream. A hello from ``s`` to ``t`` carries a fresh random
  16-byte nonce and HMAC-SHA256 under ``k(s, t)`` over job, generation, sender, receiver and
  nonce. The receiver ``t`` checks it with its own ``k(t, s)`` in constant time and refuses a
  nonce it has already accepted in this generation (it remembers the last 4096), raising
  :class:`~gradstar.errors.AuthenticationError` (UNAUTHENTICATED) that names the claimed rank;
  a refused stream files nothing in any mailbox.

  What it prevents: a process holding the job token that is not a member of the generation
  (a rank of an earlier generation, a process that never joined, a rank of another job using
  the same token) cannot open a stream as any rank, so it cannot inject messages into a recv;
  and a member ``r`` cannot open a stream as another member: a hello from ``s`` to ``t`` needs
  ``k(s, t)``, which for ``s, t != r`` only ``s``, ``t`` and the coordinator hold. A proof names
  its generation, sender and receiver, so it is void in the next generation, at another rank
  and in the other direction, and a hello captured on the wire cannot open a second stream
  while its nonce is remembered.

  What it does not prevent: a member can still corrupt every collective it takes part in (the
  hub trusts members alike), and a rank can say anything on its own streams. The proof
  authenticates the hello, not each later frame, and the sender does not authenticate the
  receiver: without TLS an on-path attacker sees the token and the keys (the session stream
  carries them) and can read or alter any stream; with TLS to the hub and between ranks it
  sees neither.
"""

from gradstar.wire import PEER_METHOD

from .endpoint import PeerEndpoint
from .link import PeerLink
from .mailbox import Mailbox, Mailboxes, tag_key
from .server import Identity, LinkLost, PeerServer

__all__ = ["PEER_METHOD", "Identity", "LinkLost", "Mailbox", "Mailboxes", "PeerEndpoint",
           "PeerLink", "PeerServer", "tag_key"]
