"""The input guards of data_parallel_step: what its arguments must look like.

Per-replica values carry a leading replica axis sharded over the data axes (made by
``replicate``); a donated buffer is never reused; the batch splits evenly over the
replicas, and on several processes it is a global array. Each guard raises an error
that names the leaf and says how to make it right.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lsgd_jax._core import _leaves, _validate


def check_axes(mesh: Mesh, axes: Any) -> tuple[str, ...]:
    """``axes`` (a name or a sequence of names) as a tuple of ``mesh``'s axis names.

    Example:
      >>> import lsgd_jax
      >>> from lsgd_jax.step._step_inputs import check_axes
      >>> check_axes(lsgd_jax.make_mesh(2, 4), "node")
      ('node',)
    """
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    missing = [a for a in names if a not in mesh.axis_names]
    if missing or not names:
        raise ValueError(
            f"data_parallel_step: the mesh has axes {mesh.axis_names}, not {missing} "
            f"(axes={axes!r}); pass axes=<its data-parallel axes> (a name or a tuple of "
            "names), or build the mesh with lsgd_jax.make_mesh()."
        )
    return names


def _path_name(path: Any) -> str:
    return jax.tree_util.keystr(path) or "(root)"


def _lead_axes(spec: Any, mesh: Any) -> tuple[str, ...]:
    """The mesh axes of size > 1 that shard the leading axis of ``spec``."""
    lead = tuple(spec)[0] if tuple(spec) else None
    lead = lead if isinstance(lead, tuple) else (lead,)
    return tuple(a for a in lead if a is not None and mesh.shape[a] > 1)


def check_replicated(tree: Any, what: str, n: int, mesh: Mesh, axes: tuple[str, ...]) -> None:
    want = tuple(a for a in axes if mesh.shape[a] > 1)
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(x, jax.Array) and x.is_deleted():
            raise ValueError(
                f"data_parallel_step: {what} leaf {_path_name(path)} was donated to an "
                "earlier call of this step, which freed its buffer. Use the values the step "
                f"returned (params, opt_state, ... = step(params, opt_state, batch)), or "
                "build the step with donate=False to keep its inputs alive."
            )
        shape = jnp.shape(x)
        if not shape or shape[0] != n:
            raise ValueError(
                f"data_parallel_step: {what} leaf {_path_name(path)} has shape {shape}, but "
                f"per-replica values need a leading axis of {n} replicas (one per device "
                f"of {axes}). Make them with lsgd_jax.replicate({what}, mesh)."
            )
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and n > 1:
            if _lead_axes(sharding.spec, sharding.mesh) != want:
                raise ValueError(
                    f"data_parallel_step: {what} leaf {_path_name(path)} is sharded as "
                    f"{sharding.spec}, not over the replica axes {axes} on its leading axis; "
                    f"a P() value would be one copy for all replicas. Make it with "
                    f"lsgd_jax.replicate({what}, mesh)."
                )


def check_example_params(params: Any) -> Any:
    """``data_parallel_step``'s ``example_params``: one replica's params (no replica
    axis), as arrays, ``jax.ShapeDtypeStruct`` leaves or Python floats.

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax.step import _step_inputs
      >>> _step_inputs.check_example_params("params")
      Traceback (most recent call last):
      ...
      TypeError: data_parallel_step: example_params: leaf (root) is 'params' (str), not ...
    """
    if not jax.tree.leaves(params):
        raise TypeError(
            "data_parallel_step: example_params must be one replica's params (a tree of "
            "arrays, or of jax.ShapeDtypeStruct, without the replica axis), e.g. the "
            f"params you pass to replicate; got {params!r:.80}, which holds no values."
        )
    _leaves.refuse_non_floating(params, "data_parallel_step: example_params")
    return params


class Inputs:
    """A step's arguments: named, placed and checked, once per new value.

    The params and states a call returns come back as the next call's arguments; held
    here (``returned``), they are recognized (``is``) and not checked again.

    Args:
      mesh, axes, with_model_state, fsdp_axes: the step's.
      first_call: ``first_call(params, opt_state)``, the checks of the first call's
        values (the build check on the user's model), run once.

    Example:
      >>> import jax.numpy as jnp, lsgd_jax
      >>> from lsgd_jax.step._step_inputs import Inputs
      >>> inputs = Inputs(lsgd_jax.make_mesh(2, 4), ("node", "local"), False, (),
      ...                 lambda p, s: None)
      >>> inputs.arguments((1, 2))
      Traceback (most recent call last):
      ...
      TypeError: data_parallel_step: the step takes (params, opt_state, batch), got 2 arguments.
    """

    def __init__(
        self,
        mesh: Mesh,
        axes: tuple[str, ...],
        with_model_state: bool,
        fsdp_axes: tuple[str, ...],
        first_call: Any,
    ) -> None:
        self.mesh, self.axes, self.with_model_state = mesh, axes, with_model_state
        self.replicas = int(np.prod([mesh.shape[a] for a in axes]))
        self._processes = len({d.process_index for d in mesh.devices.flat})
        self._split = int(np.prod([mesh.shape[a] for a in fsdp_axes]))
        self._explicit = any(
            t == jax.sharding.AxisType.Explicit
            for a, t in zip(mesh.axis_names, getattr(mesh, "axis_types", ()) or ())
            if a in axes
        )
        self._first_call: Any = first_call
        self._returned: tuple = ()

    def arguments(self, args: tuple) -> tuple[Any, Any, Any, Any]:
        """``(params, model_state, opt_state, batch)`` from the step's own arguments
        (``model_state`` None without model state; the batch placed on the data axes
        of a mesh with Explicit axes, as ``shard_map`` needs)."""
        names: tuple[str, ...] = ("params", "model_state", "opt_state", "batch")
        if not self.with_model_state:
            names = ("params", "opt_state", "batch")
        if len(args) != len(names):
            raise TypeError(
                f"data_parallel_step: the step takes ({', '.join(names)}), got {len(args)} "
                "arguments."
            )
        if self.with_model_state:
            params, model_state, opt_state, batch = args
        else:
            (params, opt_state, batch), model_state = args, None
        if self._explicit:
            batch = place_batch(batch, self.mesh, self.axes)
        return params, model_state, opt_state, batch

    def check(self, params: Any, model_state: Any, opt_state: Any, batch: Any) -> None:
        """The per-replica values (unless the last call returned them) and the batch."""
        values = (params, model_state, opt_state)
        known = len(self._returned) == 3 and all(map(operator.is_, values, self._returned))
        if not known:
            n, mesh, axes = self.replicas, self.mesh, self.axes
            check_replicated(params, "params", n, mesh, axes)
            check_replicated(opt_state, "opt_state", n, mesh, axes)
            if self.with_model_state:
                check_replicated(model_state, "model_state", n, mesh, axes)
            if self._first_call is not None:
                self._first_call(params, opt_state)
                self._first_call = None
        check_batch(batch, self.replicas, self.axes, self._processes, self._split)

    def returned(self, params: Any, model_state: Any, opt_state: Any) -> None:
        """What a call returned: checked, alive, and expected back."""
        self._returned = (params, model_state, opt_state)


def check_batch(batch: Any, n: int, axes: tuple[str, ...], processes: int, split: int = 1) -> None:
    """The batch splits evenly over ``n`` replicas (and ``split`` FSDP devices in each)."""
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = jnp.shape(x)
        if not shape or shape[0] % (n * split):
            inside = f" times the {split} devices of each (fsdp_axes)" if split > 1 else ""
            raise ValueError(
                f"data_parallel_step: batch leaf {_path_name(path)} has shape {shape}; its "
                f"leading (batch) axis must divide by the {n} replicas{inside}. Use a "
                f"global batch size that is a multiple of {n * split}."
            )
        if processes > 1 and not (isinstance(x, jax.Array) and not x.is_fully_addressable):
            warnings.warn(
                f"data_parallel_step: batch leaf {_path_name(path)} is a host-local array "
                f"on a mesh of {processes} processes, so it is taken as the GLOBAL "
                "batch (each device reads its rows of it, from its own process's copy): "
                "with different data on each process, most of it is silently dropped. Feed "
                "each process's own rows with jax.make_array_from_process_local_data("
                f"NamedSharding(mesh, P({axes})), local_batch).",
                stacklevel=5,
            )


def place_batch(batch: Any, mesh: Mesh, axes: tuple[str, ...]) -> Any:
    """``batch`` with each leaf split over ``axes`` on its leading axis (a leaf already
    laid out so is passed as it is): a mesh with Explicit axes carries shardings in the
    types, and ``shard_map`` then takes only inputs laid out as its ``in_specs``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from lsgd_jax.step._step_inputs import place_batch
      >>> mesh = jax.make_mesh((2, 4), ("node", "local"))  # Explicit axes
      >>> place_batch(jnp.ones((8, 3)), mesh, ("node", "local")).sharding.spec
      P(('node', 'local'),)
    """
    sharding = NamedSharding(mesh, P(axes))

    def place(x: Any) -> Any:
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        return jax.device_put(x, sharding)

    return jax.tree.map(place, batch)


SPECIALIZE_MODES = ("phase", "switch", "cond")


def specialize_mode(specialize: Any) -> str:
    """``data_parallel_step``'s ``specialize`` in its one spelling: ``"phase"`` (one
    program per phase; ``True`` is its alias), ``"switch"`` (one program, a
    ``lax.switch`` over the phases) or ``"cond"`` (one program, a ``lax.cond`` per
    transform; ``False`` is its alias). The two one-program spellings are also the keys
    of those programs (a phase program's key is its phase index).

    Example:
      >>> from lsgd_jax.step._step_inputs import specialize_mode
      >>> specialize_mode(True), specialize_mode("switch"), specialize_mode(False)
      ('phase', 'switch', 'cond')
      >>> specialize_mode(1)
      Traceback (most recent call last):
      ...
      ValueError: data_parallel_step: specialize must be 'phase', 'switch' or 'cond' ...
    """
    if specialize is True or specialize is False:
        return "phase" if specialize else "cond"
    if isinstance(specialize, str) and specialize in SPECIALIZE_MODES:
        return specialize
    raise ValueError(
        "data_parallel_step: specialize must be 'phase', 'switch' or 'cond' (or True for "
        f"'phase', False for 'cond'), got {specialize!r}."
    )


def check_modes(specialize: Any, lowering: Any, overlap: Any) -> str:
    """``data_parallel_step``'s ``specialize`` and ``lowering``, and the deprecated
    ``overlap`` (a DeprecationWarning when True); returns ``specialize`` in its one
    spelling (:func:`specialize_mode`).

    Example:
      >>> from lsgd_jax.step._step_inputs import check_modes
      >>> check_modes(True, "shard_map", None)
      'phase'
    """
    mode = specialize_mode(specialize)
    _validate.one_of(
        lowering,
        "data_parallel_step: lowering",
        ("shard_map", "jit"),
        ": 'shard_map' (the whole step in one shard_map) or 'jit' (the loss under plain "
        "jax.jit, the collectives in a shard_map of their own)",
    )
    if overlap is not None and _validate.boolean(overlap, "data_parallel_step: overlap"):
        warnings.warn(
            "data_parallel_step: overlap=True is deprecated and has no effect: a delayed "
            "average's mean is taken inside the step that starts it, so that the state "
            "every step returns is complete. Drop the argument.",
            DeprecationWarning,
            stacklevel=3,
        )
    return mode


def check_compiler_options(options: Any) -> tuple[tuple[str, Any], ...]:
    """``data_parallel_step``'s ``compiler_options`` as sorted items (a StepSpec field:
    hashable); a TypeError for anything but a mapping of option names to str, bool,
    int or float values.

    Example:
      >>> from lsgd_jax.step._step_inputs import check_compiler_options
      >>> check_compiler_options({"xla_embed_ir_in_executable": True})
      (('xla_embed_ir_in_executable', True),)
    """
    if options is None:
        return ()
    if not isinstance(options, Mapping) or not all(
        isinstance(k, str) and isinstance(v, (str, bool, int, float)) for k, v in options.items()
    ):
        raise TypeError(
            "data_parallel_step: compiler_options must be a dict of XLA option names to "
            f"str, bool, int or float values (as jax.jit's), got {options!r}."
        )
    return tuple(sorted(options.items()))
