"""Fixtures for the CUDA tests: the integration and parallel fixtures, and the skip every test
here carries when no CUDA device is present.

Run them by hand on a machine with a GPU (``make test-cuda``); CI has none, so there every test
of this folder is reported as skipped with the reason "needs a CUDA device". Ranks of these
tests share one GPU when the machine has only one.
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.conftest import (  # noqa: F401  (fixtures, re-exported for this folder)
    coordinator,
    start_coordinator,
)

#: Marks a test (or, as ``pytestmark``, a module) that runs only where CUDA is available.
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
