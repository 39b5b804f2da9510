"""gradstar as a torch.distributed backend.

A script written for torch.distributed switches to gradstar's hub by naming the backend::

    import gradstar                     # registers backend "gradstar" (see below)
    import torch.distributed as dist

    dist.init_process_group(backend="gradstar", init_method="gradstar://HOST:PORT?job=NAME",
                            rank=rank, world_size=world_size)

after which ``dist.all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
``broadcast``, ``barrier``, ``new_group``, torch's ``DistributedDataParallel`` (comm hooks
included) and FSDP2's ``fully_shard`` run over gradstar collectives, and ``send``/``recv`` over
gradstar's rank-to-rank peer streams, on CPU and CUDA tensors alike (DDP with
``device_ids=[i]``, FSDP2 on a ``"cuda"`` mesh). What each torch call becomes is in
:mod:`gradstar.client.torch_backend.group`; how results reach torch (threads, futures, errors) in
:mod:`gradstar.client.torch_backend.work`.

**Registration.** ``import gradstar`` registers the backend without importing torch: if torch is
already imported it registers at once, otherwise right after torch's own import finishes (see
:mod:`gradstar.client.torch_import_hook`). ``import gradstar.client.torch_backend`` (or
:func:`register_backend`) registers explicitly, for devices ``cpu`` and ``cuda``. Registering
does not change torch's default backend for any device (gloo keeps ``cpu``, NCCL ``cuda``).

**init_method.** ``gradstar://HOST:PORT?job=NAME``; every part is optional and falls back to the
``GRADSTAR_*`` environment variables (``GRADSTAR_COORDINATOR``, ``GRADSTAR_JOB``,
``GRADSTAR_RANK``, ``GRADSTAR_WORLD_SIZE``, ``GRADSTAR_TOKEN``, ...), so ``gradstar://`` alone
reads everything from the environment. The query may also carry ``timeout``,
``join_timeout``, ``connect_timeout``, ``chunk_bytes``, ``tls_ca``, ``tls_cert`` and
``tls_key`` (the token only comes from ``GRADSTAR_TOKEN`` or ``pg_options``: URLs end up in
logs). ``pg_options`` may be a dict of :class:`~gradstar.config.ClientSettings` fields. The
collective timeout and the join timeout are the query's ``timeout`` and ``join_timeout``, else
``GRADSTAR_TIMEOUT`` and ``GRADSTAR_JOIN_TIMEOUT``, else torch's ``timeout`` argument.

``gradstar://`` gives torch a process-local store (gradstar's groups need none); any of torch's
own init_methods (``env://`` under torchrun, ``tcp://``, ``file://``, a ``store=``) works too,
with the coordinator and job from the environment, and its shared store also lets groups of
other backends (``new_group(backend="gloo")``) sit next to gradstar's.

**Groups.** Each torch group is one gradstar job. The default group is the job named in the
init_method; ``new_group(ranks)`` joins job ``f"{job}/group{name}"``, where ``name`` is torch's
own name of the new group: torch numbers groups identically on every rank (every rank calls
``new_group`` in the same order, as torch requires), or names them by a hash of their ranks, so
the members agree on the job without talking to each other. A subgroup inherits the default
group's settings, timeouts included, except where ``new_group`` says otherwise: its ``timeout``
(anything but torch's default, which is what torch passes when none is given) bounds the
subgroup's collectives and join, and its ``pg_options`` override any setting.

**Shutdown.** torch's ``destroy_process_group`` shuts each group down (the rank leaves its job).
torch never does that by itself at exit, and a live group at interpreter exit aborted the process
in a probe, so an ``atexit`` hook destroys torch's process groups if the default one is gradstar's
(else it shuts gradstar's groups down) and stops the completion threads.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Mapping
from datetime import timedelta
from urllib.parse import parse_qsl, urlparse

import torch.distributed as dist
from pydantic import SecretStr
from torch.distributed.rendezvous import register_rendezvous_handler

from gradstar.client.process_group import init_process_group
from gradstar.config import ClientSettings
from gradstar.errors import ConfigurationError

from . import store_hub
from .group import ProcessGroupGradstar
from .work import CompletionThreads

log = logging.getLogger(__name__)

BACKEND = "gradstar"
SCHEME = "gradstar"
# Settings an init_method's query may carry (besides job, rank and world_size).
URL_SETTINGS = ("timeout", "join_timeout", "connect_timeout", "chunk_bytes", "tls_ca",
                "tls_cert", "tls_key")
# Where the rendezvous handler leaves the init_method for the backend factory: in the store it
# hands to torch, so the factory reads exactly the URL of the init_process_group call it serves.
_INIT_METHOD_KEY = "gradstar/init_method"

_lock = threading.Lock()
_registered = False
_completions: CompletionThreads | None = None
_live: set[ProcessGroupGradstar] = set()
#: Rank 0's default groups and the hubs they started (see store_hub).
_hubs: dict[ProcessGroupGradstar, store_hub.StoreHub] = {}
_exit_hook_installed = False


# -- init_method -------------------------------------------------------------------------------


def parse_init_method(url: str) -> dict:
    """The settings in a ``gradstar://HOST:PORT?job=NAME&...`` URL (only those it names).

    Raises:
        ConfigurationError: another scheme, or a query key that is not a known setting.
    """
    parsed = urlparse(url)
    if parsed.scheme != SCHEME:
        raise ConfigurationError(f"expected a gradstar:// init_method, got {url!r}")
    options: dict = {}
    if parsed.netloc:
        options["coordinator"] = parsed.netloc
    for key, value in parse_qsl(parsed.query):
        if key in ("rank", "world_size"):
            try:
                number = int(value)
            except ValueError:
                raise ConfigurationError(
                    f"{key} must be an integer in init_method {url!r}") from None
            if number >= 0:  # torch writes -1 for "not given"
                options[key] = number
        elif key == "job" or key in URL_SETTINGS:
            options[key] = value
        else:
            raise ConfigurationError(
                f"unknown setting {key!r} in init_method {url!r}; use job, "
                f"{', '.join(URL_SETTINGS)} (rank and world_size are init_process_group's)"
            )
    return options


def _rendezvous(url: str, timeout: timedelta | None = None, **_kwargs):
    """torch's rendezvous handler for ``gradstar://``: yields (store, rank, world_size).

    The store is a process-local HashStore: the hub is the only thing the ranks share, and
    gradstar's groups need no store. A group of another backend (``new_group(backend="gloo")``)
    does need a shared one: initialize with one of torch's init_methods for that.
    """
    options = parse_init_method(url)
    env = _env_settings()
    rank = options.get("rank", env.rank)
    world_size = options.get("world_size", env.world_size)
    if rank is None or world_size is None:
        raise ConfigurationError(
            "the gradstar backend needs this process's rank and the world size: pass rank= and "
            "world_size= to init_process_group, or set GRADSTAR_RANK and GRADSTAR_WORLD_SIZE"
        )
    store = dist.HashStore()
    store.set(_INIT_METHOD_KEY, url)
    yield store, rank, world_size
    raise RuntimeError("the gradstar:// rendezvous cannot be repeated; create a new group")


def _env_settings() -> ClientSettings:
    """The GRADSTAR_* environment as settings.

    Raises:
        ConfigurationError: a GRADSTAR_* variable holds an invalid value.
    """
    try:
        return ClientSettings()
    except ValueError as error:
        raise ConfigurationError(f"invalid GRADSTAR_* environment: {error}") from None


def _init_method_of(store) -> str | None:
    """The gradstar:// URL the rendezvous handler left in ``store``'s innermost store."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.HashStore) and store.check([_INIT_METHOD_KEY]):
        return store.get(_INIT_METHOD_KEY).decode()
    return None


# -- the factory torch calls for every group ---------------------------------------------------


def _base_options(store, is_default: bool) -> dict:
    """How a new group joins before its own pg_options: the default group's settings for a
    subgroup (when the default group is gradstar's), else the init_method's."""
    if not is_default:
        default = dist.distributed_c10d._get_default_group()
        if isinstance(default, ProcessGroupGradstar):
            return dict(default.options)
    url = _init_method_of(store)
    options = parse_init_method(url) if url else {}
    options.pop("rank", None)
    options.pop("world_size", None)
    return options


def _pg_options(given) -> dict:
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise ConfigurationError(
            "the gradstar backend takes pg_options as a dict of gradstar ClientSettings fields, "
            f"got {type(given).__name__}"
        )
    unknown = sorted(set(given) - set(ClientSettings.model_fields) - {"rank", "world_size"})
    if unknown or "rank" in given or "world_size" in given:
        raise ConfigurationError(
            f"pg_options may hold gradstar ClientSettings fields except rank and world_size; "
            f"got {sorted(given)}"
        )
    return dict(given)


def _timeouts(options: dict, given: dict, torch_timeout: timedelta, is_default: bool) -> dict:
    """The group's collective and join timeouts: torch's ``timeout`` bounds both, as with
    gloo, where nothing more specific says otherwise (see the module docstring)."""
    seconds = torch_timeout.total_seconds()
    # A subgroup's timeout other than torch's default was given to new_group for this group.
    own = not is_default and torch_timeout != dist.default_pg_timeout
    out = {}
    for name in ("timeout", "join_timeout"):
        if name in given:
            continue  # pg_options name it
        if own or (name not in options and f"GRADSTAR_{name.upper()}" not in os.environ):
            out[name] = seconds
    return out


def _create_group(backend_options, pg_options) -> ProcessGroupGradstar:
    """torch's backend factory (extended API): join this group's gradstar job."""
    is_default = len(backend_options.global_ranks_in_group) == 0
    given = _pg_options(pg_options)
    options = _base_options(backend_options.store, is_default) | given
    options |= _timeouts(options, given, backend_options.timeout, is_default)
    if isinstance(options.get("token"), str):
        options["token"] = SecretStr(options["token"])  # kept for subgroups, never printed
    job = options.pop("job", None) or _env_settings().job
    hub = None
    if is_default and _needs_store_hub(backend_options.store, options):
        hub = store_hub.find_or_make(backend_options.store, backend_options.group_rank,
                                     backend_options.group_size, backend_options.timeout)
        options["coordinator"], options["token"], job = hub.address, SecretStr(hub.token), hub.job
        # Rank 0's hub dies with rank 0 and never comes back for this job: riding through a
        # restart of it (client/reconnect.py) would only delay the named error.
        if "reconnect_timeout" not in given and "GRADSTAR_RECONNECT_TIMEOUT" not in os.environ:
            options["reconnect_timeout"] = 0.0
    inherited = dict(options, job=job)
    if not is_default:
        job = f"{job}/group{backend_options.group_id}"
    try:
        group = init_process_group(job=job, world_size=backend_options.group_size,
                                   rank=backend_options.group_rank, **options)
    except BaseException:
        if hub is not None:
            hub.stop()
        raise
    torch_group = ProcessGroupGradstar(group, _completion_threads(), options=inherited,
                                       on_shutdown=_forget)
    with _lock:
        _live.add(torch_group)
        if hub is not None and hub.owns_processes:
            _hubs[torch_group] = hub
    _install_exit_hook()
    return torch_group


def _completion_threads() -> CompletionThreads:
    global _completions
    with _lock:
        if _completions is None:
            _completions = CompletionThreads()
        return _completions


def _forget(group: ProcessGroupGradstar) -> None:
    with _lock:
        _live.discard(group)
        hub = _hubs.pop(group, None)
    if hub is not None:
        hub.stop(wait=False)  # rank 0's hub goes with rank 0's default group (see store_hub)


def _needs_store_hub(store, options: dict) -> bool:
    """Whether the default group must find its hub through torch's store: nothing names a
    coordinator (no GRADSTAR_COORDINATOR, no gradstar:// URL), as under torchrun's env://."""
    return ("coordinator" not in options and "GRADSTAR_COORDINATOR" not in os.environ
            and _init_method_of(store) is None)


# -- shutdown ----------------------------------------------------------------------------------


def _install_exit_hook() -> None:
    global _exit_hook_installed
    with _lock:
        if _exit_hook_installed:
            return
        _exit_hook_installed = True
    # Registered after torch's import, so it runs before torch's own exit handlers.
    atexit.register(shutdown_all)


def shutdown_all() -> None:
    """Shut down every gradstar torch group, stop the completion threads and wait for the hubs
    this process started to exit (the exit hook).

    If torch's default group is gradstar's, this is ``destroy_process_group()``, which also
    clears torch's registry; otherwise each gradstar group leaves its job. Never raises.
    """
    global _completions
    try:
        if dist.is_initialized() and isinstance(dist.distributed_c10d._get_default_group(),
                                                ProcessGroupGradstar):
            dist.destroy_process_group()
    except Exception:
        log.exception("destroying torch's process groups at exit failed")
    with _lock:
        remaining = list(_live)
    for group in remaining:
        try:
            group.shutdown()
        except Exception:
            log.exception("shutting down %r at exit failed", group)
    with _lock:
        completions, _completions = _completions, None
    if completions is not None:
        completions.close()
    store_hub.reap_stopped()


# -- registration ------------------------------------------------------------------------------


def register_backend() -> None:
    """Make backend ``"gradstar"`` and init_method ``gradstar://`` known to torch.distributed.

    Idempotent; ``import gradstar`` calls it (when torch is or gets imported).
    """
    global _registered
    with _lock:
        if _registered:
            return
        dist.Backend.register_backend(BACKEND, _create_group, extended_api=True,
                                      devices=["cpu", "cuda"])
        try:
            register_rendezvous_handler(SCHEME, _rendezvous)
        except RuntimeError:
            pass  # registered by an earlier copy of this module (importlib.reload)
        _registered = True
