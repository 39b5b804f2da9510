"""Rank-to-rank streams: the peer server every rank runs, and its outgoing links.

The protocol (frames in ``protos/gradstar/proto/v1/peer.proto``):

* Every rank starts a :class:`~gradstar.client.peer.server.PeerServer` before it joins
  (``peer_host``:``peer_port``, port 0 by default) and registers its address at rendezvous;
  ``Joined.peers`` tells every rank where the others are.
* The first ``send`` to a rank opens ONE long-lived bidirectional stream to it (a
  :class:`PeerLink`): a hello naming job, generation, sender and receiver, answered by an
  accept once the receiver has checked them. Every later message to that rank rides the same
  stream: a header (seq, tag, dtype, shape, chunking), chunk frames with CRC-32s (the collective
  codec of :mod:`gradstar.wire`) and an end marker with the chunk and byte count. The receiver
  acknowledges each complete message by its seq; ``send`` completes with that acknowledgement,
  so a completed send is held by the receiver.
* The receiver files each message in the :class:`~gradstar.client.peer.mailbox.Mailbox` of its
  sender, where ``recv(src, tag)`` matches it by tag. Early messages are buffered up to
  ``peer_buffer_messages`` / ``peer_buffer_bytes`` per sender; past that the server stops
  reading the stream and flow control holds the sender back.
* A rank closing its process group ends each of its streams with a goodbye (an empty end
  marker), so its receivers can tell an orderly close from a broken stream.
* Failure: channels use the hub's keepalive options (a dead or frozen peer breaks its streams
  in seconds), and every wait also watches the rank's session with the hub, whose
  generation-failure notice names the lost rank. A broken stream waits briefly for that notice
  and raises it; without one it raises :class:`~gradstar.errors.RankLostError` naming the peer.
  Every wait is bounded by the operation's timeout
  (:class:`~gradstar.errors.CollectiveTimeoutError` naming the peer).
* Security: the job token travels in call metadata and the peer server checks it with the
  hub's interceptor. With ``tls_cert`` and ``tls_key`` the peer server serves TLS with them
  (requiring client certificates from ``tls_ca`` when set), and links use the same credentials
  as the hub's channel.
"""

from gradstar.wire import PEER_METHOD

from .endpoint import PeerEndpoint
from .link import PeerLink
from .mailbox import Mailbox, tag_key
from .server import Identity, LinkLost, PeerServer

__all__ = ["PEER_METHOD", "Identity", "LinkLost", "Mailbox", "PeerEndpoint", "PeerLink",
           "PeerServer", "tag_key"]
