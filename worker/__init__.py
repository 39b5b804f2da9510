"""gradstar.worker: the per-host agent that starts and watches training processes.

The agent and launcher arrive with the runtime work (issue 6); the package exists now so the
distribution's layout is fixed and its packaging test covers it.
"""
