"""Register gradstar's torch.distributed backend on ``import gradstar``, without importing torch.

torch is optional for gradstar and takes seconds to import, so ``import gradstar`` must not pull
it in. :func:`install` therefore registers the backend at once if torch is already imported, and
otherwise puts a one-shot finder on ``sys.meta_path`` that lets torch's own loader run and
registers right after ``import torch`` finishes (``import torch.distributed`` imports ``torch``
first, so that is covered too). Either way the user's only change is ``import gradstar``.

A failure to register never breaks ``import torch`` or ``import gradstar``: it becomes a warning,
and torch's "Invalid backend: 'gradstar'" then names the problem when the backend is used.
This module imports nothing from torch and nothing heavy from gradstar.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings


def register_now() -> None:
    """Register the backend with the (imported) torch; warn instead of raising."""
    package = sys.modules.get(f"{__package__}.torch_backend")
    if package is not None and not hasattr(package, "register_backend"):
        # torch is being imported by the backend package itself, which registers as its own
        # import ends.
        return
    try:
        import torch.distributed

        if not torch.distributed.is_available():
            return
        from .torch_backend import register_backend

        register_backend()
    except Exception as error:
        warnings.warn(f"gradstar could not register its torch.distributed backend: {error!r}",
                      RuntimeWarning, stacklevel=2)


class TorchImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of top-level ``torch`` to register afterwards."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch":
            return None
        # One shot: leave before asking the other finders, so they never see this one again.
        uninstall()
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module) -> None:
            try:
                original(module)
            finally:
                # Only this loader instance was patched; put its own method back.
                del loader.exec_module
            register_now()

        loader.exec_module = exec_module
        return spec


def install() -> None:
    """Register now if torch is imported, else once it is. Idempotent."""
    if "torch" in sys.modules:
        register_now()
    elif not any(isinstance(f, TorchImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, TorchImportHook())


def uninstall() -> None:
    """Remove the pending hook, if any."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, TorchImportHook)]


__all__ = ["TorchImportHook", "install", "register_now", "uninstall"]
