"""What the loop checks before it runs, and the state it starts from: its arguments,
a user's initial state, a fresh state for a new job.
"""

from __future__ import annotations

import inspect
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from lsgd_jax._core import _validate
from lsgd_jax.elastic import _attempts, _membership, _process
from lsgd_jax.elastic._initialize import _TIMEOUTS, _positive_seconds


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
    from lsgd_jax._core._replicas import num_replicas, replica_spec

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
    axes = _attempts.loop_axes(inside)

    def shard_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
        spec = replica_spec(shape, mine, axes, inside)
        return NamedSharding(mine, spec).shard_shape((num_replicas(mine, axes), *shape))

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
    from lsgd_jax.step import data_parallel_step

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
    axes = _attempts.loop_axes(_inside(options))
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
    if initial_state is not None or first_step != 0 or ran or not _process.newcomer():
        return False
    return _membership._latest(_membership.client()) is None


def _fresh_state(
    mesh: Mesh, init_params: Any, tx: Any, init_model_state: Any, inside: tuple[str, ...] = ()
) -> tuple:
    """A fresh state over ``mesh``: ``(params, [model_state,] opt_state)``, replicated
    (with ``inside``, FSDP axes: one replica a process, sharded over its devices)."""
    from lsgd_jax.mesh import replicate

    def place(tree):
        return replicate(tree, mesh, _attempts.loop_axes(inside), shard_over=inside or None)

    fresh = (place(init_params), place(tx.init(init_params)))
    if init_model_state is None:
        return fresh
    return fresh[0], place(init_model_state), fresh[1]


def _inside(options: dict[str, Any]) -> tuple[str, ...]:
    """The FSDP axes of ``step_options`` (``fsdp_axes``): ``("local",)`` or none.

    Example:
      >>> from lsgd_jax.elastic._start import _inside
      >>> _inside({"fsdp_axes": "local"}), _inside({})
      (('local',), ())
    """
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
