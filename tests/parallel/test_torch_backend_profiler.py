"""gradstar's collectives in torch's profiler, as gloo's: one ``gradstar:<op>`` event per
collective, with the inputs' shapes, marked async, in the autograd profiler and in
``torch.profiler`` alike.

The same probe (``torch_probe_script.py profiler``: all_reduce, an async broadcast, all_gather
and barrier under each profiler) runs on two ranks over gradstar and over gloo, and the events
must be the same but for the backend's name.
"""

from __future__ import annotations

import asyncio

import pytest

from .test_torch_backend_timeouts import run_probe

WORLD = 2
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, list[dict]]:
    init = f"file://{tmp_path_factory.mktemp('gloo-rendezvous') / 'profiler'}"

    async def both():
        return await asyncio.gather(run_probe("profiler", WORLD, 180),
                                    run_probe("profiler", WORLD, 180, gloo_init=init))

    gradstar_reports, gloo_reports = asyncio.run(both())
    return {"gradstar": gradstar_reports, "gloo": gloo_reports}


def test_collectives_are_named_and_shaped_like_gloos(reports):
    for rank in range(WORLD):
        ours = reports["gradstar"][rank]["autograd"]
        assert [name for name, *_ in ours] == ["gradstar:all_reduce", "gradstar:broadcast",
                                               "gradstar:all_gather", "gradstar:barrier"]
        assert [shapes for _, shapes, *_ in ours] == [[[3, 4]], [[3, 4]], [[3, 4]], []]
        assert all(is_async and count == 1 for _, _, is_async, count in ours), ours
        gloo = reports["gloo"][rank]["autograd"]
        assert [[name.replace("gloo:", "gradstar:"), *rest] for name, *rest in gloo] == ours


def test_torch_profiler_records_them_too(reports):
    for rank in range(WORLD):
        ours = reports["gradstar"][rank]["kineto"]
        gloo = reports["gloo"][rank]["kineto"]
        assert [[name.replace("gloo:", "gradstar:"), shapes] for name, shapes in gloo] == ours
        assert [name for name, _ in ours] == ["gradstar:all_reduce", "gradstar:broadcast",
                                              "gradstar:all_gather", "gradstar:barrier"]
