"""What each collective means (see :mod:`.table`)."""

from .geometry import *  # noqa: F403
