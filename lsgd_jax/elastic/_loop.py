"""Elastic post-local SGD: keep training when a process dies, take it back when it returns.

Local SGD does not need every node on every step, so when a process dies the others
can go on and average among themselves. :class:`ElasticLoop` runs
:func:`~lsgd_jax.data_parallel_step` one step at a time inside JAX's ``live_devices``
barrier (every live process agrees on who is alive and on whether the step succeeded).
On a failure (a dead process, a collective that timed out) it

1. rebuilds the mesh over the live processes (the ``"node"`` axis shrinks; each device
   keeps its own replica's params and optimizer state: no checkpoint reload),
2. re-runs the failed step from the state before it (nothing is donated),
3. keeps every survivor's step counters equal (they never diverge: a step is
   committed on all processes or on none), and the means are over the live replicas,
4. logs who failed at which step and how long recovery took.

A process that (re)starts joins the running job: it receives the survivors' consensus
params (and model state, if any), one live replica's optimizer state and the step
counters, and is in the next step's averages; the survivors do not stop. A process
that hangs without dying (its heartbeats stop, e.g. SIGSTOP) is treated as dead after
the heartbeat timeout; one that stalls inside Python is ended by the loop's watchdog
(``stall_timeout_s``).

No trainer needs to be special: run JAX's coordination service in a process of its own
(``python -m lsgd_jax.elastic_coordinator --port P --processes N``) and start every
trainer with ``initialize(..., external_coordinator=True)``; then any trainer, process 0
included, may die and come back, and the lowest live process that holds the model leads
each membership change. Without it, process 0 hosts the service: if process 0 dies,
every process ends with an error (JAX terminates them). A process that (re)starts after
the run is over prints one line saying so and exits with status 0.

Start every process with :func:`initialize` (instead of ``jax.distributed.initialize``),
which turns on JAX's recoverability, sets collective timeouts and keeps a dead peer
from ending the others. The user's ``batch_fn(step, layout)`` returns this process's
rows of the global batch; ``layout`` (a :class:`Layout`) says which processes are live
and where this one sits, so each live process keeps feeding its own rows.

Example (each of N processes runs this, with its own ``process_id``)::

    import lsgd_jax.elastic as elastic
    elastic.initialize("127.0.0.1:9876", num_processes=3, process_id=i, num_cpu_devices=2)
    loop = elastic.ElasticLoop(loss_fn, tx, init_params, batch_fn)
    result = loop.run(num_steps=200)   # survives dead processes; takes back restarted ones
    model = loop.consensus(result.params)
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lsgd_jax._core import _validate
from lsgd_jax.elastic import _attempts, _elastic_checkpoint, _membership
from lsgd_jax.elastic._membership import CoordinatorLostError, Layout, LeftBehindError
from lsgd_jax.step._compile_cache import use_compilation_cache

logger = logging.getLogger("lsgd_jax.elastic")

__all__ = [
    "CoordinatorLostError",
    "ElasticLoop",
    "ElasticResult",
    "Layout",
    "LeftBehindError",
    "StepRecord",
    "initialize",
    "shutdown",
]

_CPU_FLAGS = "--xla_cpu_collective_timeout_seconds={t}"
# From JAX's fault-tolerance guide: a failed NCCL collective must not end the process,
# and collectives with a failed participant must be cancelled.
_GPU_FLAGS = (
    "--xla_gpu_nccl_terminate_on_error=false",
    "--xla_gpu_nccl_async_execution=true",
    "--xla_gpu_nccl_blocking_communicators=false",
)
# What initialize() set, for the checks of how the timeouts relate (ElasticLoop's).
_TIMEOUTS: dict[str, int] = {}
_GPU_ENV = {
    "XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE": "1",
    "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": "1",
}


def initialize(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    *,
    platform: str = "cpu",
    num_cpu_devices: int | None = None,
    local_device_ids: list[int] | None = None,
    heartbeat_timeout_s: int = 3,
    collective_timeout_s: int = 5,
    initialization_timeout_s: int = 60,
    external_coordinator: bool = False,
    compilation_cache: str | bool = True,
) -> None:
    """``jax.distributed.initialize`` for an elastic run; call it before any JAX work.

    Turns on ``jax_enable_recoverability`` (a dead peer no longer ends this process),
    makes collectives with a dead participant fail after ``collective_timeout_s``
    instead of hanging (CPU: ``--xla_cpu_collective_timeout_seconds``; GPU: the NCCL
    flags of JAX's fault-tolerance guide), selects gloo on CPU, and connects.

    Args:
      coordinator_address: ``host:port`` of the coordination service: process 0's, or
        with ``external_coordinator`` that of ``lsgd_jax.elastic_coordinator``.
      num_processes: processes in the job (a restarted one counts once).
      process_id: this process's index; a restarted process reuses its old index.
      platform: ``"cpu"`` or ``"gpu"``.
      num_cpu_devices: CPU devices for this process (CPU only; default JAX's).
      local_device_ids: the GPUs this process uses (e.g. ``[process_id]`` for one
        process per GPU on one host); default all it sees.
      heartbeat_timeout_s: seconds without heartbeats after which a process is dead.
      collective_timeout_s: seconds a collective waits for a missing peer (CPU).
      initialization_timeout_s: seconds to wait for the coordinator (a process started
        when process 0 is gone fails after this instead of retrying forever).
      external_coordinator: the service runs in a process of its own (``python -m
        lsgd_jax.elastic_coordinator --port P --processes N``, started before the
        trainers, stopped after them): no trainer hosts it, so any trainer, process 0
        included, may die and come back. Process 0 then binds JAX's own (unused)
        service to a free port of 127.0.0.1.
      compilation_cache: keep compiled programs on disk, so that a restarted or
        rejoining process loads the programs it compiled before instead of compiling
        them again (see :func:`lsgd_jax.use_compilation_cache`): True (default) for
        ``$LSGD_JAX_COMPILATION_CACHE`` or ``~/.cache/lsgd_jax/jax-compilation-cache``
        (a folder JAX already uses is kept), a path for that folder, False to leave
        JAX's settings alone.

    Returns:
      None.

    Raises:
      ValueError: a bad argument value (checked before any JAX or network work).
      TypeError: an argument of the wrong type (checked likewise).
      RuntimeError: JAX's backend is already running.
      CoordinatorLostError: no coordination service at the address after
        ``initialization_timeout_s`` (process 0 is gone or not started).

    Example:
      >>> import lsgd_jax.elastic as elastic
      >>> elastic.initialize("127.0.0.1:9876", 3, 0, num_cpu_devices=2)  # doctest: +SKIP
      >>> # with `python -m lsgd_jax.elastic_coordinator --port 9876 --processes 3`:
      >>> elastic.initialize("127.0.0.1:9876", 3, 0, external_coordinator=True)  # doctest: +SKIP
    """
    from lsgd_jax._core import _compat

    _check_initialize_args(
        coordinator_address,
        num_processes,
        process_id,
        platform,
        num_cpu_devices,
        local_device_ids,
        (heartbeat_timeout_s, collective_timeout_s, initialization_timeout_s),
    )
    if not isinstance(external_coordinator, bool):
        raise TypeError(
            f"initialize: external_coordinator must be True or False, got {external_coordinator!r}."
        )
    if not isinstance(compilation_cache, (str, os.PathLike, bool)):
        raise TypeError(
            "initialize: compilation_cache must be True, False or a folder's path, got "
            f"{compilation_cache!r}."
        )
    if _compat.backends_are_initialized():
        raise RuntimeError(
            "lsgd_jax.elastic.initialize: JAX's backend is already running, so its "
            "collective timeouts can no longer be set; call initialize() before any "
            "other JAX call (jax.devices(), creating arrays, jit)."
        )
    if process_id != 0 or external_coordinator:  # else process 0 starts the service
        _wait_for_coordinator(coordinator_address, initialization_timeout_s, external_coordinator)
    flags = [_CPU_FLAGS.format(t=collective_timeout_s)]
    if platform == "gpu":
        flags += list(_GPU_FLAGS)
        os.environ.update(_GPU_ENV)
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()
    _TIMEOUTS.update(
        heartbeat=heartbeat_timeout_s, collective=collective_timeout_s, processes=num_processes
    )
    jax.config.update("jax_enable_recoverability", True)
    if compilation_cache is not False:
        use_compilation_cache(None if compilation_cache is True else compilation_cache)
    if platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if num_cpu_devices is not None:
            jax.config.update("jax_num_cpu_devices", num_cpu_devices)
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        heartbeat_timeout_seconds=heartbeat_timeout_s,
        initialization_timeout=initialization_timeout_s,
        # Process 0's own service, unused when the job's service runs elsewhere: any free port.
        coordinator_bind_address="127.0.0.1:0" if external_coordinator else None,
    )
    _membership.set_external_coordinator(external_coordinator)
    if external_coordinator and process_id == 0:
        _membership.forget_global_topology()


def _check_initialize_args(
    address: Any,
    num_processes: Any,
    process_id: Any,
    platform: Any,
    num_cpu_devices: Any,
    local_device_ids: Any,
    timeouts: tuple[Any, Any, Any],
) -> None:
    """initialize's argument checks, all before any JAX or network work."""
    if platform not in ("cpu", "gpu"):
        raise ValueError(f"initialize: platform must be 'cpu' or 'gpu', got {platform!r}.")
    _host_port(address)
    n = _validate.positive_int(num_processes, "initialize: num_processes")
    if not _validate._is_int(process_id) or not 0 <= process_id < n:
        raise ValueError(
            f"initialize: process_id must be in [0, {n}) for num_processes={n}, got "
            f"{process_id!r}; give each process its own index 0 .. {n - 1} (a restarted "
            "process reuses its old one)."
        )
    _validate.optional_positive_int(num_cpu_devices, "initialize: num_cpu_devices")
    if local_device_ids is not None and not (
        isinstance(local_device_ids, (list, tuple))
        and all(_validate._is_int(i) and i >= 0 for i in local_device_ids)
    ):
        raise ValueError(
            "initialize: local_device_ids must be None or a list of device indices (ints "
            f">= 0), got {local_device_ids!r}."
        )
    names = ("heartbeat_timeout_s", "collective_timeout_s", "initialization_timeout_s")
    for name, value in zip(names, timeouts):
        _validate.positive_int(value, f"initialize: {name}")


def _host_port(address: Any) -> tuple[str, int]:
    """``(host, port)`` of a ``"host:port"`` address; ValueError saying the form else."""
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"initialize: coordinator_address must be 'host:port' (e.g. '10.0.0.1:9876', "
            f"with the port process 0's service listens on, 1-65535), got {address!r}."
        )
    return host, int(port)


def _positive_seconds(value: Any, name: str, none_ok: bool = False) -> float | None:
    """``value`` as seconds > 0 (finite; None too when ``none_ok``), else a clear error."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(
            f"{name} must be a positive number of seconds{' or None' if none_ok else ''}, "
            f"got {value!r} ({type(value).__name__})."
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{name} must be a positive number of seconds"
            f"{' (or None: never)' if none_ok else ''}, got {value!r}."
        )
    return float(value)


def _wait_for_coordinator(address: str, timeout_s: float, external: bool = False) -> None:
    """Returns once ``address`` accepts TCP connections; CoordinatorLostError after
    ``timeout_s`` (else JAX would retry for its whole initialization timeout and then
    abort the process)."""
    host, port = _host_port(address)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host or "127.0.0.1", port), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                host = (
                    "the coordinator process (python -m lsgd_jax.elastic_coordinator) is"
                    if external
                    else "process 0 is"
                )
                raise CoordinatorLostError(
                    f"lsgd_jax.elastic.initialize: no coordination service at {address} "
                    f"after {timeout_s} s ({e}); {host} gone (the run is over or failed) "
                    f"or not started. Start the job again with {host.split(' is')[0]}."
                ) from e
            time.sleep(0.2)


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One completed step.

    Attributes:
      step: the step's index.
      live_processes: the processes that ran it.
      loss: the mean loss over the live replicas.
      recovery_s: on the first step completed after a failure or a membership change,
        the seconds from the start of the first attempt at it to its end (else None).
      failures: what went wrong on the attempts before (empty if none).
      aux: with ``step_options={"has_aux": True}``, the step's aux as numpy arrays
        (reduced over the live replicas as ``data_parallel_step`` reduces it); else None.
    """

    step: int
    live_processes: tuple[int, ...]
    loss: float
    recovery_s: float | None
    failures: tuple[str, ...] = ()
    aux: Any = None


@dataclasses.dataclass
class ElasticResult:
    """What :meth:`ElasticLoop.run` returns.

    Attributes:
      params, opt_state: this process's per-replica state over ``layout.mesh``.
      layout: the membership the last step ran on.
      records: one :class:`StepRecord` per step this process completed.
      model_state: with ``step_options={"with_model_state": True}``, the per-replica
        model state over ``layout.mesh`` (else None).
    """

    params: Any
    opt_state: Any
    layout: Layout
    records: list[StepRecord]
    model_state: Any = None

    @property
    def state(self) -> tuple[Any, ...]:
        """The loop's state, as ``run(initial_state=...)`` takes it (``(params,
        opt_state)``, or ``(params, model_state, opt_state)`` with model state)."""
        if self.model_state is None:
            return self.params, self.opt_state
        return self.params, self.model_state, self.opt_state


def _state_names(init_model_state: Any) -> tuple[str, ...]:
    """The parts of the loop's state, in order (model state between params and opt_state)."""
    if init_model_state is None:
        return ("params", "opt_state")
    return ("params", "model_state", "opt_state")


def _check_state(
    state: Any,
    init_params: Any,
    tx: Any,
    init_model_state: Any = None,
    inside: tuple[str, ...] = (),
) -> None:
    """ValueError unless ``state`` is ``(params, opt_state)`` (``(params, model_state,
    opt_state)`` with model state) of this loop's structure and shapes, with one
    replica on each of this process's devices (what a step needs), or with ``inside``
    (FSDP) one replica over them, each device holding its shard of every leaf."""
    from lsgd_jax.mesh._mesh import _num_replicas, replica_spec

    where = "ElasticLoop.run: initial_state"
    names = _state_names(init_model_state)
    if not (isinstance(state, (tuple, list)) and len(state) == len(names)):
        raise ValueError(
            f"{where} must be ({', '.join(names)}) (e.g. result.state), got {type(state)}"
            f"{f' of length {len(state)}' if isinstance(state, (tuple, list)) else ''}."
        )
    like: tuple[Any, ...] = (init_params, jax.eval_shape(tx.init, init_params))
    if init_model_state is not None:
        like = (init_params, init_model_state, like[1])
    devices = set(jax.local_devices())
    mine = Mesh(np.array(jax.local_devices()).reshape(1, -1), _attempts.AXES)
    axes = _attempts.data_axes(inside)

    def shard_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
        spec = replica_spec(shape, mine, axes, inside)
        return NamedSharding(mine, spec).shard_shape((_num_replicas(mine, axes), *shape))

    for name, tree, model in zip(names, state, like):
        got: Any = jax.tree.structure(tree)
        if got != jax.tree.structure(model):
            raise ValueError(
                f"{where}: its {name} tree does not have the structure of this loop's (from "
                f"init_params, init_model_state and tx.init): {got} is not "
                f"{jax.tree.structure(model)}; pass this loop's own state (a result, or a "
                "checkpoint restored with it as the template)."
            )
        flat, _ = jax.tree_util.tree_flatten_with_path(tree)
        for (path, x), m in zip(flat, jax.tree.leaves(model)):
            shards = {s.device: s.data.shape for s in getattr(x, "addressable_shards", [])}
            per_device = set(shards.values())
            shape = tuple(getattr(m, "shape", np.shape(m)))
            if devices - set(shards) or per_device != {shard_shape(shape)}:
                how = (
                    f"one replica of shape {shape} on each of this process's {len(devices)} "
                    "devices, like a result's params and opt_state or "
                    "lsgd_jax.replicate(x, mesh)"
                    if not inside
                    else f"one replica of shape {shape} split over this process's "
                    f"{len(devices)} devices (shards of shape {shard_shape(shape)}), like a "
                    "result's params and opt_state (step_options fsdp_axes='local')"
                )
                raise ValueError(
                    f"{where}: {name}{jax.tree_util.keystr(path)} (shape {np.shape(x)}, "
                    f"{len(shards)} local shards of shapes {sorted(per_device)}) must have a "
                    f"leading replica axis with {how}."
                )


def _start_state(
    num_steps: Any, first_step: Any, initial_state: Any, ran: bool, template: tuple[Any, ...]
) -> Any:
    """run's argument checks; the state to start from (None: fresh). On an error, the
    other processes are told (they stop too instead of going on without this one)."""
    try:
        _validate.positive_int(num_steps, "ElasticLoop.run: num_steps")
        if not _validate._is_int(first_step) or not 0 <= first_step < num_steps:
            raise ValueError(
                f"ElasticLoop.run: first_step must be in [0, num_steps), got first_step="
                f"{first_step!r} and num_steps={num_steps}."
            )
        if initial_state is None and ran:
            raise ValueError(
                "ElasticLoop.run: this loop ran before; pass initial_state=result.state "
                "and first_step=<its step> to go on from where it stopped."
            )
        if initial_state is None and first_step > 0:
            raise ValueError(
                f"ElasticLoop.run: first_step={first_step} needs initial_state=(params, "
                f"opt_state), the state at step {first_step} (e.g. restored from a "
                "checkpoint): a fresh state is the state at step 0, and its counters "
                "would not match the steps. (A process that rejoins a running job calls "
                "run(num_steps) alone: it learns the step from the others.)"
            )
        if initial_state is not None:
            _check_state(initial_state, *template)
    except Exception as e:
        step = first_step if _validate._is_int(first_step) else 0
        _membership.post_user_error(jax.process_index(), step, _attempts.first_line(e))
        raise
    return None if initial_state is None else tuple(initial_state)


def _record(
    step: int, processes: Any, loss: Any, recovery: Any, failures: Any, aux: Any = None
) -> StepRecord:
    """The step's record; a warning if it followed failures or a membership change."""
    if aux is not None:  # reduced over the replicas: every local shard holds it whole
        aux = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), aux)
    record = StepRecord(step, processes, float(loss), recovery, failures, aux)
    if failures or recovery is not None:
        logger.warning(
            "lsgd_jax.elastic: step %d completed on processes %s after %s (recovery %.2f s)",
            step,
            list(processes),
            "; ".join(failures) or "a membership change",
            recovery or 0.0,
        )
    return record


_FORBIDDEN_OPTIONS = ("donate", "axes", "overlap")


def _check_model_state(options: dict[str, Any], init_model_state: Any) -> None:
    """``init_model_state`` goes with ``step_options={"with_model_state": True}``, and
    only with it: a clear error naming the missing half otherwise."""
    for name in ("with_model_state", "has_aux"):
        if not isinstance(options.get(name, False), bool):
            raise ValueError(
                f"ElasticLoop: step_options {name!r} must be True or False, got {options[name]!r}."
            )
    on = options.get("with_model_state", False)
    if on and init_model_state is None:
        raise ValueError(
            'ElasticLoop: step_options={"with_model_state": True} needs init_model_state= '
            "(the initial model state, e.g. batch-norm statistics, the same on every process)."
        )
    if not on and init_model_state is not None:
        raise ValueError(
            "ElasticLoop: init_model_state was given, but the step takes no model state; "
            'pass step_options={"with_model_state": True} (and a loss_fn(params, '
            "model_state, batch) -> (loss, new_model_state)), or drop init_model_state."
        )


def _check_loop_args(
    loss_fn: Any,
    tx: Any,
    step_options: Any,
    stall_timeout_s: Any,
    max_failures: Any,
    init_model_state: Any = None,
) -> tuple[float | None, int]:
    """ElasticLoop's argument checks, all before it needs ``jax.distributed``: the step
    options by building the step once on one device (it checks them as the real one
    will), so that a bad one fails here and not in every attempt."""
    from lsgd_jax.step._step import data_parallel_step

    options = dict(step_options or {})
    bad = sorted(set(options) & set(_FORBIDDEN_OPTIONS))
    if bad:
        raise ValueError(
            f"ElasticLoop: step_options {bad} cannot be set: a retried step needs its "
            "inputs (no donation), the loop builds the mesh and its axes itself, and "
            "overlap is deprecated (no effect); remove them."
        )
    known = [
        name
        for name, p in inspect.signature(data_parallel_step).parameters.items()
        if p.kind is p.KEYWORD_ONLY and name not in _FORBIDDEN_OPTIONS
    ]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(
            f"ElasticLoop: unknown step_options {unknown}; the elastic loop passes these "
            f"keywords to data_parallel_step: {known}."
        )
    _check_model_state(options, init_model_state)
    stall = _positive_seconds(stall_timeout_s, "ElasticLoop: stall_timeout_s", none_ok=True)
    _check_stall_against_timeouts(stall)
    failures = _validate.positive_int(max_failures, "ElasticLoop: max_failures")
    one = Mesh(np.array(jax.local_devices()[:1]).reshape(1, 1), _attempts.AXES)
    axes = _attempts.data_axes(_inside(options))
    data_parallel_step(loss_fn, tx, one, axes=axes, donate=False, **options)
    return stall, failures


def _check_stall_against_timeouts(stall: float | None) -> None:
    """The watchdog must outlast a survivor's wait for a dead peer: a collective waits up
    to ``collective_timeout_s`` for it (that wait is the attempt's own work to the
    watchdog), and the others learn of the death after ``heartbeat_timeout_s``."""
    if stall is None or _TIMEOUTS.get("processes", 1) == 1:  # no peer to wait for
        return
    wait = _TIMEOUTS["collective"] + _TIMEOUTS["heartbeat"]
    if stall <= wait:
        raise ValueError(
            f"ElasticLoop: stall_timeout_s={stall:g} s is not longer than initialize()'s "
            f"collective_timeout_s={_TIMEOUTS['collective']} plus heartbeat_timeout_s="
            f"{_TIMEOUTS['heartbeat']} ({wait} s): a survivor waiting in a collective for a "
            "dead peer would be ended by its own watchdog before the failure is detected. "
            f"Use a stall_timeout_s well above {wait} s (and above your slowest step), or "
            "shorter collective/heartbeat timeouts. See 'Timeouts' in docs/failures.md."
        )


def _fresh_job(initial_state: Any, first_step: Any, ran: bool) -> bool:
    """Whether run() starts a job that may resume from a checkpoint: no state given,
    this loop never ran, and no membership recorded yet (a process that restarts in a
    running job joins it instead)."""
    if initial_state is not None or first_step != 0 or ran or not _membership.newcomer():
        return False
    return _membership._latest(_membership.client()) is None


def _fresh_state(
    mesh: Mesh, init_params: Any, tx: Any, init_model_state: Any, inside: tuple[str, ...] = ()
) -> tuple:
    """A fresh state over ``mesh``: ``(params, [model_state,] opt_state)``, replicated
    (with ``inside``, FSDP axes: one replica a process, sharded over its devices)."""
    from lsgd_jax.mesh._mesh import replicate

    def place(tree):
        return replicate(tree, mesh, _attempts.data_axes(inside), shard_over=inside or None)

    fresh = (place(init_params), place(tx.init(init_params)))
    if init_model_state is None:
        return fresh
    return fresh[0], place(init_model_state), fresh[1]


def _inside(options: dict[str, Any]) -> tuple[str, ...]:
    """The FSDP axes of ``step_options`` (``fsdp_axes``): ``("local",)`` or none."""
    fsdp = options.get("fsdp_axes")
    if fsdp is None:
        return ()
    if fsdp in ("local", ("local",), ["local"]):
        return ("local",)
    raise ValueError(
        f"ElasticLoop: step_options fsdp_axes={fsdp!r} is not supported: the loop's mesh "
        "has one row per process, axes ('node', 'local'). Pass fsdp_axes='local' (each "
        "process one replica, its params, optimizer and averager state sharded over its "
        "devices; averages across processes), or leave it out (one replica a device)."
    )


def _split_outputs(out: tuple[Any, ...], n_state: int) -> tuple[Any, Any, Any]:
    """A step's outputs ``(*state, loss[, aux])`` as ``(state, loss, aux or None)``."""
    state, rest = tuple(out[:n_state]), out[n_state:]
    return state, rest[0], rest[1] if len(rest) > 1 else None


def _result(state: tuple[Any, ...], layout: Layout, records: list[StepRecord]) -> ElasticResult:
    params, *model_state, opt_state = state
    return ElasticResult(params, opt_state, layout, records, *model_state)


def _consensus_work(model_state: bool) -> Callable[..., Any]:
    """The consensus attempt's work: the mean params (and model state) of the replicas."""
    from lsgd_jax.mesh._mesh import consensus

    def work(state, step, layout):
        if model_state:
            return consensus(state[0]), consensus(state[1])
        return consensus(state[0])

    return work


class _TrainWork:
    """One training attempt's work: the step's checkpoint save (when due), the batch of
    this process's rows, and the step program of the membership's mesh (built once per
    device order and kept with its compiled programs)."""

    def __init__(self, loss_fn, tx, options, batch_fn, checkpoints, on_attempt, inside) -> None:
        self._loss_fn, self._tx, self._options = loss_fn, tx, options
        self._batch_fn, self._checkpoints, self._on_attempt = batch_fn, checkpoints, on_attempt
        self._steps: dict[tuple[int, ...], Any] = {}
        self._axes = _attempts.data_axes(inside)

    def step_fn(self, layout: Layout):
        from lsgd_jax.step._step import data_parallel_step

        key = tuple(d.id for d in layout.mesh.devices.flat)
        if key not in self._steps:
            self._steps[key] = data_parallel_step(
                self._loss_fn, self._tx, layout.mesh, axes=self._axes, donate=False, **self._options
            )
        return self._steps[key]

    def __call__(self, state, step: int, layout: Layout):
        ckpt = self._checkpoints
        if ckpt is not None and ckpt.due(step):
            ckpt.save(state, step, layout.processes)  # the state step `step` starts from
        if self._on_attempt is not None:
            self._on_attempt(step, layout)
        sharding = NamedSharding(layout.mesh, P(self._axes))
        local = self._batch_fn(step, layout)
        batch = jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local)
        return _split_outputs(self.step_fn(layout)(*state, batch), len(state))


class _Restart:
    """What the live processes restart from when none of them holds the model (every
    holder died, e.g. the sole survivor while a newcomer was still joining): the
    newest finalized checkpoint, or the fresh state if there is none yet and the run
    began fresh at step 0.

    Attributes:
      fresh_origin: whether this process's run began from the fresh state at step 0.
    """

    def __init__(self, checkpoints: _elastic_checkpoint.Checkpoints, template: tuple) -> None:
        self._checkpoints, self._template = checkpoints, template
        self.fresh_origin = False

    def step(self) -> int | None:
        """The step to restart from (on the membership's leader); None: nothing."""
        found = _elastic_checkpoint.latest_step(self._checkpoints.directory)
        if found is not None:
            return found
        return 0 if self.fresh_origin else None

    def state(self, mesh: Mesh, step: int) -> tuple[Any, ...]:
        """The state at ``step`` over ``mesh`` (every member of the view reads it)."""
        if step == 0:  # step 0 is never saved: it is the fresh state
            return _fresh_state(mesh, *self._template)
        init_params, tx, init_model_state, _ = self._template
        return self._checkpoints.restore(init_params, tx, init_model_state, step, mesh)


def _begin(attempts, checkpoints, template, num_steps: int, first_step: int, initial_state):
    """``(first step, state)`` of a run: the given state, the checkpoint a new job resumes
    from, or fresh (None); a process that (re)started after the run was over exits."""
    ran = attempts.view is not None
    if attempts.restart is not None:
        attempts.restart.fresh_origin = initial_state is None and first_step == 0
    if checkpoints is not None and _fresh_job(initial_state, first_step, ran):
        init_params, tx, init_model_state, _ = template
        resumed = checkpoints.resume(init_params, tx, init_model_state, num_steps)
        if resumed is not None:
            first_step, initial_state = resumed
    state = _start_state(num_steps, first_step, initial_state, ran, template)
    attempts.given = state  # moved onto the mesh by the first attempt that succeeds
    attempts.records_started, attempts.last_step = False, num_steps
    end = _membership.finished_step() if _membership.newcomer() else None
    if end is not None and end >= num_steps:  # (re)started after the run was over
        raise _membership.run_over(jax.process_index(), end)
    return first_step, state


class ElasticLoop:
    """A training loop that survives dead processes and takes restarted ones back.

    Every process of the job builds the same loop and calls :meth:`run`. Each step runs
    inside ``live_devices`` on a mesh of the live processes (one row, i.e. node, per
    process), built per membership and cached with its compiled programs.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (as for
        :func:`~lsgd_jax.data_parallel_step`).
      tx: the optimizer, e.g. ``optax.chain(post_local_sgd(...), optax.sgd(...),
        model_averaging(...))``.
      init_params: the initial params (the same on every process); a joining process
        uses them only for their shapes.
      batch_fn: ``batch_fn(step, layout) -> tree`` of this process's rows of the global
        batch of ``step`` (``layout.devices_per_process`` times the rows per replica;
        with ``fsdp_axes="local"`` its one replica's rows), e.g. rows chosen by
        ``layout.row`` or by the process index. Called at the start of every attempt
        of a step: a retried step calls it again with the same ``step``, so return the
        same rows for the same step and process. It is part of the step (keep it well
        under the collective timeout); an error it raises ends the run. The contract
        in full: "What you provide" in docs/failures.md.
      step_options: more keyword arguments for ``data_parallel_step`` (e.g.
        ``{"specialize": "switch"}``), checked here; donation and overlap are off (a
        retry needs the state before the step). ``{"fsdp_axes": "local"}``: each
        process is one replica spanning its devices (HSDP): its params, optimizer
        and averager state are sharded over them (1/devices of the memory each),
        its rows of the batch split over them inside the step, and averages (and a
        joiner's healing, and checkpoints) move each shard across processes only;
        build ``tx`` for replicas that are processes (e.g. ``post_local_sgd(start,
        process_group="node", post_local_gradient_allreduce=False)``: the gradients
        are already the node's mean). ``{"has_aux": True}``: each
        :class:`StepRecord` carries the step's aux. ``{"with_model_state": True}``
        (with ``init_model_state``): the state is ``(params, model_state, opt_state)``.
      init_model_state: the initial model state (e.g. batch-norm statistics; the same
        on every process), one per replica like the params, for ``step_options=
        {"with_model_state": True}`` only. A joining process gets the mean of the live
        replicas' model state (as for params); checkpoints and results carry it.
      stall_timeout_s: end this process if one attempt's own work (everything but the
        barrier that waits for the others and the wait for the membership's leader)
        goes on this many seconds without compiling (None: never). Compiling a program
        (the first step, a new phase, a new membership's mesh) is not a stall, however
        long. With several processes it must be longer than initialize()'s
        ``collective_timeout_s + heartbeat_timeout_s`` (else ValueError): a survivor
        waits that long in a collective for a dead peer. See "Timeouts" in
        docs/failures.md.
      max_failures: consecutive failed attempts after which :meth:`run` gives up. Only
        failures that can mean a dead peer (JAX's runtime errors: a collective or the
        coordination service failed or timed out; ``live_devices``'s
        ``ProcessFailureError``) are retried; any other error (the loss's, the
        batch's, a bad ``initial_state``) is raised at once, and the other processes
        stop too with a ``RuntimeError`` naming it.
      on_step: called with each :class:`StepRecord` as the step completes.
      on_attempt: called with ``(step, layout)`` as each attempt starts its step
        (after the step's checkpoint save has started, if it saves one).
      checkpoint_dir: a folder to save checkpoints into and resume from (None: none).
        :meth:`run` at the start of a job resumes from its newest finalized step (on
        any number of processes: the replicas are resized). And when no live process
        holds the model any more (the last holder died while a restarted process was
        joining), the live ones restart from it (from the fresh state before the
        first save), instead of ending with ``CoordinatorLostError``.
      checkpoint_every: save the state at the start of every step that is a multiple
        of it (step 0 excepted), in the format of :func:`~lsgd_jax.save_checkpoint`;
        needs ``checkpoint_dir``. The live processes save it (the lowest writes,
        asynchronously); a death during a save leaves the previous checkpoints
        readable and the save is done again over the survivors. Call :meth:`shutdown`
        at the end: it waits for this process's writes in flight.

    Example:
      >>> import lsgd_jax.elastic as elastic
      >>> loop = elastic.ElasticLoop(loss_fn, tx, params, batch_fn)  # doctest: +SKIP
      >>> result = loop.run(100)                                     # doctest: +SKIP
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        tx: Any,
        init_params: Any,
        batch_fn: Callable[[int, Layout], Any],
        *,
        step_options: dict[str, Any] | None = None,
        stall_timeout_s: float | None = 300.0,
        max_failures: int = 20,
        on_step: Callable[[StepRecord], None] | None = None,
        on_attempt: Callable[[int, Layout], None] | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
        init_model_state: Any = None,
    ) -> None:
        directory, every = _elastic_checkpoint.check_args(checkpoint_dir, checkpoint_every)
        stall_timeout_s, max_failures = _check_loop_args(
            loss_fn, tx, step_options, stall_timeout_s, max_failures, init_model_state
        )
        options = dict(step_options or {})
        inside = _inside(options)
        self._checkpoints = None
        if directory is not None and every is not None:
            self._checkpoints = _elastic_checkpoint.Checkpoints(directory, every, inside)
        self._template = (init_params, tx, init_model_state, inside)
        self._work = _TrainWork(
            loss_fn, tx, options, batch_fn, self._checkpoints, on_attempt, inside
        )
        self._on_step = on_step
        restart = _Restart(self._checkpoints, self._template) if self._checkpoints else None
        self._attempts = _attempts.Attempts(
            self._fresh, stall_timeout_s, max_failures, restart, shard_over=inside
        )
        self._step = 0

    @property
    def layout(self) -> Layout | None:
        """The membership the last committed step ran on (None before the first)."""
        return self._attempts.layout

    def _fresh(self, mesh: Mesh) -> tuple[Any, ...]:
        return _fresh_state(mesh, *self._template)

    def run(
        self,
        num_steps: int,
        *,
        first_step: int = 0,
        initial_state: tuple[Any, ...] | None = None,
    ) -> ElasticResult:
        """Trains until step ``num_steps`` through failures and rejoins.

        With ``checkpoint_dir``, a job's first ``run`` (no ``initial_state``, and no
        running job to join) resumes from the folder's newest finalized checkpoint, the
        step process 0 finds, on whatever number of processes this job has.

        Args:
          num_steps: the step to stop at (a joining process stops there too).
          first_step: the step to start from: 0, or the step of the state passed as
            ``initial_state`` (the same on every process).
          initial_state: ``(params, opt_state)`` (``(params, model_state, opt_state)``
            with model state) with a leading replica axis, this
            process's replicas on its devices over any mesh: a restored checkpoint, or a
            previous run's ``result.state`` to go on. Default: fresh
            (``init_params`` and ``tx.init``); required when this loop ran before.

        Returns:
          An :class:`ElasticResult` with this process's state and its records.

        Raises:
          SystemExit: with status 0, after one line saying so, in a process that
            (re)started after the run reached ``num_steps`` (nothing left to join).
          ValueError: a bad argument; or the checkpoint to resume from is at or past
            ``num_steps``.
          CoordinatorLostError: no live process holds the model any more and there is
            nothing to restart from (no ``checkpoint_dir``).

        Example:
          >>> first = loop.run(100)  # doctest: +SKIP
          >>> more = loop.run(200, first_step=100,  # doctest: +SKIP
          ...                 initial_state=first.state)
        """
        attempts = self._attempts
        step, state = _begin(
            attempts, self._checkpoints, self._template, num_steps, first_step, initial_state
        )
        records: list[StepRecord] = []
        while step < num_steps:
            (state, loss, aux), step, recovery, failures = attempts.retrying(
                "training step", state, step, self._work
            )
            assert self.layout is not None  # set by the attempt that succeeded
            record = _record(step, self.layout.processes, loss, recovery, failures, aux)
            records.append(record)
            attempts.records_started = True
            if self._on_step is not None:
                self._on_step(record)
            step += 1
        self._step, attempts.last_step = step, None
        if self._checkpoints is not None:
            self._checkpoints.poll()  # a failed write is an error (shutdown waits for them)
        _membership.mark_finished(step)
        assert state is not None and self.layout is not None  # num_steps >= 1 ran
        return _result(state, self.layout, records)

    def consensus(self, result: ElasticResult, *, model_state: bool = False) -> Any:
        """The mean of the live replicas' params (a collective: every live process calls
        it), retried through failures like a step.

        Args:
          result: what :meth:`run` returned.
          model_state: also the mean of the live replicas' model state (with
            ``step_options={"with_model_state": True}`` only).

        Returns:
          The params without the replica axis, on every process; with ``model_state``,
          ``(params, model_state)``.
        """
        if model_state and result.model_state is None:
            raise ValueError(
                "ElasticLoop.consensus: model_state=True, but this loop has no model "
                'state (step_options={"with_model_state": True} and init_model_state).'
            )
        out, _, _, _ = self._attempts.retrying(
            "consensus", result.state, self._step, _consensus_work(model_state)
        )
        return out

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Leaves the run cleanly (:func:`shutdown` over this loop's live processes), once
        this process's checkpoint writers in flight are done.

        Args:
          timeout_s: how long process 0 waits for the others to say they are done (when
            it hosts the coordination service).

        Returns:
          None.
        """
        if self._checkpoints is not None:
            self._checkpoints.wait()  # this process's checkpoint writers finish first
        shutdown(self.layout.processes if self.layout else (), timeout_s)


def shutdown(processes: Any = None, timeout_s: float = 30.0) -> None:
    """Leaves an elastic job cleanly: every process calls it at the end.

    With the coordination service in a process of its own (``initialize(...,
    external_coordinator=True)``), each process just says it is done and disconnects.
    Else process 0 hosts the service, so it leaves last: it waits (up to ``timeout_s``)
    until every other process of ``processes`` has said it is done and has
    disconnected. If it left first, JAX would end the others (they are still talking to
    the service when they shut down).

    Args:
      processes: the live processes (e.g. ``result.layout.processes``); default all.
      timeout_s: how long process 0 waits for each of the others.

    Returns:
      None.

    Example:
      >>> lsgd_jax.elastic.shutdown(result.layout.processes)  # doctest: +SKIP
    """
    _positive_seconds(timeout_s, "lsgd_jax.elastic.shutdown: timeout_s")
    c, me = _membership.client(), jax.process_index()
    if me != 0 or _membership.external_coordinator():
        c.key_value_set(f"{_membership.PREFIX}/done/{me}", "1", allow_overwrite=True)
        jax.distributed.shutdown()
        return
    others = [p for p in (processes or range(jax.process_count())) if p != 0]
    for p in others:
        try:
            c.blocking_key_value_get(f"{_membership.PREFIX}/done/{p}", int(timeout_s * 1000))
        except Exception:  # a process that died after its last step
            logger.warning("lsgd_jax.elastic: process %d did not say it is done", p)
    # A barrier of the live ones among them: it returns once the others have
    # disconnected (or their heartbeats stopped).
    c.get_live_nodes([0, *others])
    jax.distributed.shutdown()
