"""What NAT traversal's local tunnel costs per byte (:class:`gradstar.transport.traversal.Tunnel`):
the CPU of moving bytes over a loopback TCP connection directly, and the same bytes through a
tunnel (two sockets joined with ``splice(2)``), in one process and one run.

How to reproduce
    python benchmarks/tunnel_cost.py --gb 1 --runs 3

Each run sends ``--gb`` GB in 1 MiB writes from a thread and reads it in another; the process's
CPU seconds per GB (every thread's, ``time.process_time``) for the direct connection, then for
the tunnelled one; the difference is the tunnel's. A punched connection has a tunnel on each
end. Not asserted: any timing.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

from gradstar.transport.traversal import Tunnel

MIB = 1 << 20


def _pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
    return client, accepted


def one(nbytes: int, tunnelled: bool) -> tuple[float, float]:
    """(CPU-s per GB, wall s) of moving ``nbytes`` once."""
    sender, far = _pair()
    tunnel = None
    if tunnelled:  # sender -> far ~ tunnel ~ near -> receiver
        near, receiver = _pair()
        tunnel = Tunnel(far, near).start()
    else:
        receiver = far

    def send() -> None:
        block = b"\0" * MIB
        for _ in range(nbytes // MIB):
            sender.sendall(block)
        sender.shutdown(socket.SHUT_WR)

    thread = threading.Thread(target=send)
    cpu, wall = time.process_time(), time.perf_counter()
    thread.start()
    buffer = bytearray(MIB)
    got = 0
    while n := receiver.recv_into(buffer):
        got += n
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    thread.join()
    for sock in (sender, receiver):
        sock.close()
    if tunnel is not None:
        tunnel.close()
    assert got == nbytes // MIB * MIB, got
    return cpu / (got / 1e9), wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="GB per run (default 1)")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    nbytes = int(args.gb * 1e9)
    direct, tunnelled = [], []
    for _ in range(args.runs):  # alternated, so that a busy moment hits both
        direct.append(one(nbytes, False)[0])
        tunnelled.append(one(nbytes, True)[0])
    d, t = statistics.median(direct), statistics.median(tunnelled)
    print(f"direct loopback:   {d:.2f} CPU-s/GB (runs {', '.join(f'{x:.2f}' for x in direct)})")
    print(f"through a tunnel:  {t:.2f} CPU-s/GB "
          f"(runs {', '.join(f'{x:.2f}' for x in tunnelled)})")
    print(f"the tunnel's own:  {t - d:.2f} CPU-s/GB per end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
