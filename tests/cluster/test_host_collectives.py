"""The two-level broadcast, all_gather and reduce_scatter (:mod:`gradstar.client.hierarchy`) on
an emulated cluster, each host with its node-local shard: every result equals the flat path's
(one stripe per host, every rank its own) for int32 and float64, with hosts' ranks interleaved
and contiguous, and the bytes over each host link match the per-link model of
docs/multi-host.md, against the flat path's in the same run.

- 2 hosts x 2 ranks: all three ops take the two levels.
- 2 hosts of 2 and 1 ranks: broadcast takes the two levels; all_gather and reduce_scatter keep
  the flat path (their leaders' segments would differ in size), so their bytes are the flat
  path's, and still exact.

The model, per call, for S bytes per rank, H hosts, host h running R_h ranks (n in all; R when
every host runs as many), one node-local shard per host (K = H stripes), each way of host h's
link; ``model()`` computes it:

- broadcast from a rank on host s. Two-level: out of s 2(H-1)/H·S, into s 0; into every other
  host S, out of it (H-2)/H·S. Flat: out of s (H-1)/H·S + (n-R_s)/H·S, into s
  (H-1)(R_s-1)/H·S; into another host h (1 + R_h(H-1))/H·S, out of it (n-R_h-1)/H·S.
- all_gather. Two-level: (H-1)·R·S each way. Flat: out R_h(H-1)/H·S + (n-R_h)(n-1)/H·S, in
  (n-R_h)/H·S + R_h(H-1)(n-1)/H·S ((H-1)·R²·S when uniform).
- reduce_scatter. Two-level: (H-1)/H·(1+1/H)·S each way. Flat: out R_h(H-1)/H·S +
  (n-R_h)/(nH)·S, in (n-R_h)/H·S + R_h(H-1)/(nH)·S.

Each measured direction must be within [0.95 x model, 1.1 x model + 2% of S per call]: the 2%
holds the barriers, headers and TCP acknowledgements that a model of payload bytes leaves out
(a direction the model puts nothing on carries only those). The rank program is
:mod:`tests.cluster.host_ops_rank`. Needs root and iproute2 (CI runs as root); elsewhere it
fails saying why.
"""

from __future__ import annotations

import sys

import pytest

from tests.cluster.jobs import hosts_network, job_on_hosts, wait_reports

pytestmark = pytest.mark.timeout(300)
NBYTES, ITERS = 4 << 20, 2
SLACK = 0.02  # of S per call: barriers, headers and TCP acknowledgements


def model(op: str, path: str, counts: list[int], host: int, src: int) -> tuple[float, float]:
    """(in, out) bytes per call over ``host``'s link, in units of S, broadcasting from a rank on
    host ``src`` (see the module docstring)."""
    h, n, r = len(counts), sum(counts), counts[host]
    uniform = len(set(counts)) == 1
    if op == "broadcast" and path == "two-level":
        return (0.0, 2 * (h - 1) / h) if host == src else (1.0, (h - 2) / h)
    if op == "broadcast":
        if host == src:
            return (h - 1) * (r - 1) / h, (h - 1) / h + (n - r) / h
        return (1 + r * (h - 1)) / h, (n - r - 1) / h
    if path == "two-level" and uniform:
        each = (h - 1) * r if op == "all_gather" else (h - 1) / h * (1 + 1 / h)
        return each, each
    if op == "all_gather":
        return (n - r) / h + r * (h - 1) * (n - 1) / h, r * (h - 1) / h + (n - r) * (n - 1) / h
    return (n - r) / h + r * (h - 1) / (n * h), r * (h - 1) / h + (n - r) / (n * h)


@pytest.mark.parametrize("counts", [[2, 2], [2, 1]], ids=["2x2", "2+1"])
def test_two_level_broadcast_all_gather_and_reduce_scatter_are_exact_and_carry_the_model(
        tmp_path, counts):
    names = [f"host{h}" for h in range(len(counts))]
    out = tmp_path / "out"
    out.mkdir()
    world = sum(counts)
    rank_argv = [sys.executable, "-m", "tests.cluster.host_ops_rank", str(out), str(NBYTES),
                 str(ITERS), ",".join(map(str, counts))]
    with hosts_network(names) as network:
        with job_on_hosts(network, tmp_path, counts, rank_argv) as (procs, _hub):
            exact = wait_reports(out, "exact", world, procs, 150)
            assert sorted(a.rsplit(":", 1)[0] for a in exact[0]["shards"]) == sorted(
                network.addresses.values()), "not one node-local shard per host"
            problems = [p for r in exact for p in r["problems"]]
            assert not problems, "\n".join(problems)
            reports = {r["host"]: r for r in wait_reports(out, "bytes", world, procs, 150)}

    failed = []
    for host, report in sorted(reports.items()):
        for op, paths in report["ops"].items():
            per_call = report["sizes"][op] * ITERS
            for path, got in paths.items():
                want_in, want_out = model(op, path, counts, names.index(host),
                                          names.index(report["src_host"]))
                print(f"{host} {op:14} {path:9} {got['seconds'] * 1000:.0f} ms per call")
                for way, measured, want in (("in", got["rx"], want_in),
                                            ("out", got["tx"], want_out)):
                    ratio = measured / per_call
                    print(f"{host} {op:14} {path:9} {way:3}: {ratio:.3f} S per call "
                          f"(model {want:.3f} S)")
                    if not 0.95 * want <= ratio <= 1.1 * want + SLACK:
                        failed.append(f"{host} {op} {path} {way}: {ratio:.3f} S per call, "
                                      f"model {want:.3f} S")
    assert not failed, "bytes off the model:\n" + "\n".join(failed)
    if len(set(counts)) == 1:  # the saving the two levels are for, on every host link
        for host, report in reports.items():
            for op, paths in report["ops"].items():
                two, flat = max(paths["two-level"].values()), max(paths["flat"].values())
                assert two < 0.8 * flat, f"{host} {op}: two-level {two} bytes, flat {flat}"
