"""Which coordinator leads, as operators see it: ``Admin.GetLeadership`` (``gradstar admin
leader``), the ``leadership`` part of ``/status.json`` and its line on the status page, and
the ``gradstar_leader*`` series of ``/metrics``. One reply, built once per look, feeds all
three.

Without ``--ha`` a coordinator leads alone: term 0, no election, no takeovers. How long the
ranks waited is the rendezvous' count: the generations taken back from rejoining ranks (after
a restart or a takeover) and the longest wait at the latest of them.
"""

from __future__ import annotations

import html

from gradstar.proto.v1 import admin_pb2 as apb

from ..leadership import Leadership


def leadership_reply(lead: Leadership | None, address: str, jobs) -> apb.GetLeadershipResponse:
    """What ``lead`` (None: no ``--ha``) says of who leads; ``address`` is this coordinator's,
    ``jobs`` the rendezvous' jobs (their rebuilds and the ranks' waits)."""
    counters = [job.counters for job in jobs.values()]
    waits = dict(rebuilds=sum(c.rebuilds for c in counters),
                 rejoin_wait_seconds=max((c.rejoin_wait_seconds for c in counters), default=0.0))
    if lead is None:
        return apb.GetLeadershipResponse(elected=False, role="leader", address=address,
                                         leader=address, **waits)
    return apb.GetLeadershipResponse(
        elected=True, role=lead.role.value, address=lead.address, leader=lead.leader,
        term=lead.term, leader_since_unix=lead.since, takeovers=lead.takeovers, **waits)


def leadership_json(reply: apb.GetLeadershipResponse) -> dict:
    """The reply as ``/status.json`` carries it."""
    return {"elected": reply.elected, "role": reply.role, "address": reply.address,
            "leader": reply.leader, "term": reply.term,
            "leader_since_unix": reply.leader_since_unix, "takeovers": reply.takeovers,
            "rebuilds": reply.rebuilds, "rejoin_wait_seconds": reply.rejoin_wait_seconds}


def leadership_html(view: dict | None) -> str:
    """The status page's line (empty without ``--ha``)."""
    if not view or not view["elected"]:
        return ""
    who = ("this coordinator leads" if view["role"] == "leader"
           else f"this coordinator is {view['role']}; the leader is {view['leader'] or 'none'}")
    return (f'<p data-field="leadership">Election (--ha): {html.escape(who)}, term '
            f"{view['term']}, takeovers {view['takeovers']}; ranks waited up to "
            f"{view['rejoin_wait_seconds']:.2f} s at the latest rebuild.</p>")


def leadership_metrics(reply: apb.GetLeadershipResponse) -> str:
    """The ``gradstar_leader*`` families of ``/metrics``."""
    families = [
        ("gradstar_leader", "gauge", "1 while this coordinator leads (always, without --ha).",
         int(reply.role == "leader")),
        ("gradstar_leader_term", "gauge", "The leader's term: the etcd revision at which it "
         "won (0 without --ha).", reply.term),
        ("gradstar_leader_since_seconds", "gauge", "When the leader won, in Unix seconds (0 "
         "without --ha).", f"{reply.leader_since_unix:.3f}"),
        ("gradstar_takeovers_total", "counter", "Leaderships after the first in the "
         "election's history.", reply.takeovers),
        ("gradstar_rejoin_wait_seconds", "gauge", "The longest a rank waited at the latest "
         "rebuild of any job here (from losing its coordinator to the rebuild).",
         f"{reply.rejoin_wait_seconds:.3f}"),
    ]
    return "".join(f"# HELP {name} {text}\n# TYPE {name} {kind}\n{name} {value}\n"
                   for name, kind, text, value in families)


__all__ = ["leadership_html", "leadership_json", "leadership_metrics", "leadership_reply"]
