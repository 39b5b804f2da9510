"""What operators see of sync-mode DDP steps: /metrics (Prometheus' own parser), /status.json,
the status page and ``gradstar admin steps``, against a live coordinator whose ledger has a
closed step, a dropped contribution and a rank out of the live set."""

from __future__ import annotations

import json

import numpy as np

from gradstar.client.steps import StepsClient
from gradstar.sync_modes import Quorum
from tests.integration.conftest import close_all, join_all

from .conftest import http_get, run_gradstar
from .test_metrics import samples

MODE = Quorum(min_ranks=2, timeout=0.0)


async def test_steps_are_in_metrics_status_and_admin(start_coordinator):
    hub = await start_coordinator(metrics_port=0)
    groups = await join_all(hub.address, 3, job="sm")
    ranks = [StepsClient.for_group(pg, "ddp") for pg in groups]
    try:
        g = np.ones(4, np.float32)
        await ranks[0].contribute(MODE, 0, 0, 1.0, g, 10)
        await ranks[1].contribute(MODE, 0, 0, 1.0, g, 10)  # closes step 1 with two of three
        late = await ranks[2].contribute(MODE, 0, 0, 1.0, g, 10)
        assert not late.accepted
        hub.steps.rank_gone("sm", 2, "lost")

        _, _, body = await http_get(hub.metrics_port, "/metrics")
        got = samples(body.decode())
        model = {("job", "sm"), ("model", "ddp")}
        assert got[("gradstar_steps_closed", frozenset(model))] == 1
        assert got[("gradstar_steps_live_ranks", frozenset(model))] == 2
        assert got[("gradstar_steps_dropped_total", frozenset(model))] == 1
        assert got[("gradstar_steps_staleness_total", frozenset({*model, ("staleness", "0")}))] == 2
        assert got[("gradstar_steps_rank_live", frozenset({*model, ("rank", "2")}))] == 0
        assert got[("gradstar_steps_rank_dropped_total",
                    frozenset({*model, ("rank", "2")}))] == 1

        _, _, body = await http_get(hub.metrics_port, "/status.json")
        (view,) = json.loads(body)["steps"]
        assert (view["job"], view["steps"], view["live"], view["dropped"]) == ("sm", 1, [0, 1], 1)
        _, _, page = await http_get(hub.metrics_port, "/")
        assert b"Sync-mode steps" in page and b"Quorum(min_ranks=2" in page

        code, out, err = await run_gradstar("admin", "steps", "--coordinator", hub.address,
                                            "--job", "sm", "--json", timeout=30)
        assert code == 0, err
        (m,) = json.loads(out)["models"]
        assert (m["steps"], m["live"], m["dropped"], m["staleness"]) == (1, [0, 1], 1, {"0": 2})
        assert [r["live"] for r in m["ranks"]] == [True, True, False]
        code, out, _ = await run_gradstar("admin", "steps", "--coordinator", hub.address,
                                          "--job", "sm", timeout=30)
        assert code == 0 and "1 steps closed, 2 of 3 ranks live, 1 dropped" in out
        code, _, err = await run_gradstar("admin", "steps", "--coordinator", hub.address,
                                          "--job", "nope", timeout=30)
        assert code != 0 and "no job named 'nope' has sync-mode steps" in err
    finally:
        for r in ranks:
            await r.close()
        await close_all(groups)
