"""gradstar.transport: the gRPC and HTTP edge that the hub, the shards, the ranks' peer servers
and the worker agent all share.

- :mod:`.channels`: every channel and server option (with why), credentials, ``open_channel``
  and ``call_metadata``.
- :mod:`.serve`: ``serve``, the one way every gRPC server is built and bound.
- :mod:`.auth`: the token interceptor every server installs, ``check_job_access`` for the
  servicers, and ``bearer`` for clients.
- :mod:`.job_tokens`: per-job tokens, made and verified with the operator's job secret.
- :mod:`.status`: gradstar errors to gRPC statuses and back.
- :mod:`.http`: a GET-only HTTP endpoint (``/metrics``, ``/healthz``).
- :mod:`.bind`: whether an address can be listened on, and bind failures as one line of advice.

Nothing here knows about collectives, jobs only by name (what a job token opens), and nothing
here imports torch.
"""
