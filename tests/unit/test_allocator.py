"""The allocator's glibc calls (gradstar.allocator): glibc is looked up once per process, not
on every call (``ctypes.util.find_library`` runs ``ldconfig`` as a subprocess, and the hub
trims its heap from its event loop)."""

from __future__ import annotations

import subprocess

from gradstar import allocator


def test_trimming_again_runs_no_subprocess(monkeypatch):
    allocator.trim_heap()  # the first call may look glibc up

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"a subprocess was started: {args!r}")

    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    for _ in range(3):
        assert allocator.trim_heap() in (True, False)
    assert allocator.tune_allocator() in (True, False)
    assert allocator.share_malloc_arena() in (True, False)
