"""The demo job: the built-in training job and ``gradstar demo``, which runs and reports it.

:mod:`.train` is what each rank runs (``python -m gradstar.worker.demo.train``), :mod:`.modes`
how each mode (DDP, LocalSGD, FSDP, Pipeline) trains a step, :mod:`.spirals` the data and model,
:mod:`.command` ``gradstar demo`` (an embedded coordinator, N ranks, a progress bar and a
report), :mod:`.replay` the distributed run's arithmetic in one process, :mod:`.report` the JSON
report and plot, and :mod:`.streaming` the Streaming DiLoCo demo (its replicas run as
``python -m gradstar.worker.demo.streaming``).

Nothing is re-exported here: :mod:`.train` and :mod:`.streaming` run as ``python -m``, and a
package that imported them first would make runpy warn and execute them a second time
as ``__main__``.
"""

__all__: list[str] = []
