"""gradstar.worker: what starts and watches training processes, and the built-in training job.

- :mod:`.supervisor` starts, streams, restarts and stops a host's rank processes;
- :mod:`.launch` (``gradstar launch``) and :mod:`.agent` (``gradstar worker``) drive it;
- :mod:`.train` is the built-in training job (spirals MLP, DDP or LocalSGD, elastic) and
  :mod:`.spirals` its data and model; :mod:`.demo` (``gradstar demo``) runs and reports it;
- :mod:`.admin_client` and :mod:`.admin_tables` are ``gradstar admin``.
"""
