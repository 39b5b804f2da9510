"""gradstar.worker: what starts and watches training processes, the admin CLI, and the demo job.

- :mod:`.host` is the host side: the supervisor that starts, streams, restarts and stops a
  host's rank processes, and the launcher (``gradstar launch``) and per-host agent
  (``gradstar worker``) that drive it;
- :mod:`.admin` is ``gradstar admin``: the Admin-service client, the commands and the tables;
- :mod:`.demo` is the built-in training job (spirals MLP, DDP, LocalSGD, FSDP or Pipeline,
  elastic; ``python -m gradstar.worker.demo.train``) and ``gradstar demo``, which runs it,
  replays it in one process and reports.
"""
