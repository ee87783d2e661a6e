"""What a step checks before it runs: every phase of the optimizer, traced on the mesh.

A step specialized per phase traces a phase's program when that phase first occurs: a
node-local mean after the switch (step 100, or 10,000), a hierarchical level's average,
a two-level strategy's inner axis. A mesh that one of them cannot use would then fail
hours into a run. So the optimizer's update is traced (not compiled, not run) once per
phase inside a ``shard_map`` over the step's data axes: every group resolves and every
collective is typed as in the real step, and what fails is reported with the phase and
the fix, before the first step.

Two passes. When the step is built (:func:`check_tx`), on the user's params if the
builder was given them, else on a one-leaf stand-in: a check that depends on the
model's shapes (:class:`ModelShapeError`, e.g. too few values for the fragments) is then
left to the second pass. At the first call (:func:`check_model`), on the abstract shapes
of the params and state the step is called with. Only errors raised by lsgd_jax itself
are reported: a failure in the user's own transformations is left to the step's trace,
which reports it as usual.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from lsgd_jax._core import _collectives
from lsgd_jax._core import _state_protocol as sp
from lsgd_jax._core._collectives import AxisNotBoundError
from lsgd_jax._core._errors import ModelShapeError
from lsgd_jax.step import _pairing, _phase

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # lsgd_jax/


def probe() -> dict[str, Any]:
    """One tiny leaf, so that every mean has work (made when called: creating an array
    at import would start JAX's backend before ``elastic.initialize`` can set it up)."""
    return {"probe": jnp.zeros((2,), jnp.float32)}


def explicit_axes(mesh: Mesh, axes: Sequence[str]) -> tuple[str, ...]:
    """The axes of ``axes`` that ``mesh`` types as Explicit (``jax.make_mesh``'s default).

    Example:
      >>> import jax, lsgd_jax
      >>> from lsgd_jax.step import _preflight
      >>> _preflight.explicit_axes(lsgd_jax.make_mesh(2, 4), ("node", "local"))
      ()
    """
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()) or ()))
    return tuple(a for a in axes if types.get(a) == AxisType.Explicit)


def _raised_by_us(error: BaseException) -> bool:
    """Whether the innermost frame of ``error``'s traceback is lsgd_jax's own code."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(_PACKAGE + os.sep)


def describe_phase(opt_state: Any, index: int) -> str:
    """What each hook and averager does in phase ``index``, in words.

    Example:
      >>> import optax, lsgd_jax
      >>> from lsgd_jax.step import _preflight
      >>> tx = optax.chain(lsgd_jax.post_local_sgd(8), optax.sgd(0.1),
      ...     lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(4, warmup_steps=8)))
      >>> _preflight.describe_phase(tx.init({}), 1)
      "post_local_sgd's node-local gradient mean (from step 8 on), an average over every data axis"
    """
    words = []
    for state, digit in _digits(opt_state, index):
        if state.KIND == sp.HOOK:
            if digit:
                words.append("post_local_sgd's global gradient mean (the warm-up)")
            elif state.post_local_gradient_allreduce:
                words.append(
                    "post_local_sgd's node-local gradient mean (from step "
                    f"{state.start_localSGD_iter} on)"
                )
            else:
                words.append("post_local_sgd without a gradient mean (local SGD)")
        elif state.KIND == sp.AVERAGER:
            words.append(_averager_words(state, digit))
    return ", ".join(words) or "the only phase"


def _digits(opt_state: Any, index: int) -> list[tuple[Any, int]]:
    """Each branching state with its digit of phase ``index`` (see ``_phase.pin``)."""
    states = _phase.branching_states(opt_state)
    digits = []
    for state in reversed(states):
        index, digit = divmod(index, state.num_phases)
        digits.append(digit)
    return list(zip(states, reversed(digits)))


def _averager_words(state: Any, digit: int) -> str:
    schedule = state.averager.sync_schedule
    lands, level = divmod(digit, schedule.num_levels + 1)
    landing = ", a delayed average landing" if lands else ""
    if not level:
        return "no average" + landing
    groups = state.averager.groups
    group = groups[min(level, len(groups)) - 1]
    return "an average over " + ("every data axis" if group is None else repr(group)) + landing


def check_tx(
    tx: Any,
    mesh: Mesh,
    axes: Sequence[str],
    what: str,
    check_order: bool,
    params: Any = None,
) -> Any:
    """The checks a step runs when it is built: the chain's order
    (``check_configuration``) and every phase on the mesh (:func:`check_phases`).

    Args:
      tx: the optimizer.
      mesh: the step's mesh.
      axes: its data axes.
      what: the caller's name, for errors.
      check_order: whether to refuse a hook not first or an averaging not last.
      params: one replica's params (arrays, or ``jax.ShapeDtypeStruct`` leaves) to check on;
        None: a one-leaf stand-in, on which checks that depend on the model's shapes
        are skipped (:func:`check_model` runs them at the first call).

    Returns:
      The optimizer state checked, or None where ``tx.init`` cannot init the stand-in
      (e.g. ``optax.masked`` with a mask tree): the first call checks then.

    Example:
      >>> import optax, lsgd_jax
      >>> from lsgd_jax.step import _preflight
      >>> tx = optax.chain(lsgd_jax.post_local_sgd(8), optax.sgd(0.1))
      >>> state = _preflight.check_tx(tx, lsgd_jax.make_mesh(2, 4), ("node", "local"),
      ...     "demo", check_order=True)
      >>> lsgd_jax.num_phases(state)
      2
    """
    stand_in = params is None
    if stand_in:
        try:
            params = probe()
            state = tx.init(params)
        except Exception:  # noqa: BLE001  (a transform needing the real params' structure)
            return None
    else:
        params = abstract(params)
        state = jax.eval_shape(tx.init, params)
    _pairing.check_configuration(state, check_order=check_order, tx=tx)
    check_phases(tx, mesh, axes, what, state, params, stand_in=stand_in)
    return state


def check_model(
    tx: Any,
    mesh: Mesh,
    axes: Sequence[str],
    what: str,
    check_order: bool,
    params: Any,
    opt_state: Any,
) -> None:
    """The checks of :func:`check_tx` on the params and state a step is called with.

    Args:
      tx, mesh, axes, what, check_order: as for :func:`check_tx`.
      params: the per-replica params (a leading replica axis), arrays or abstract.
      opt_state: the per-replica optimizer state, likewise.

    Raises:
      ValueError: (or the library's own class, e.g. ``AxisNotBoundError``) a phase
        cannot run on this model or mesh; says which phase and how to fix it.

    Example:
      >>> import jax.numpy as jnp, optax, lsgd_jax
      >>> from lsgd_jax.step import _preflight
      >>> mesh = lsgd_jax.make_mesh(2, 4)
      >>> avg = lsgd_jax.PeriodicModelAverager(4, warmup_steps=2, fragments=4)
      >>> tx = optax.chain(lsgd_jax.post_local_sgd(2), optax.sgd(0.1),
      ...     lsgd_jax.model_averaging(avg))
      >>> p = lsgd_jax.replicate(jnp.zeros(3), mesh)
      >>> _preflight.check_model(tx, mesh, ("node", "local"), "demo", True, p,
      ...     lsgd_jax.replicate(tx.init(jnp.zeros(3)), mesh))
      Traceback (most recent call last):
      ...
      lsgd_jax._core._errors.ModelShapeError: demo: the optimizer cannot run on this model ...
    """
    params, opt_state = one_replica((params, opt_state))
    _pairing.check_configuration(opt_state, check_order=check_order, tx=tx)
    check_phases(tx, mesh, axes, what, opt_state, params)


def signature(tree: Any) -> Any:
    """A hashable key of ``tree``'s structure, shapes and dtypes (what a check saw).

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax.step import _preflight
      >>> _preflight.signature([jnp.zeros(2)]) == _preflight.signature([jnp.ones(2)])
      True
    """
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((np.shape(x), str(x.dtype)) for x in leaves)


def one_replica(tree: Any) -> Any:
    """One replica's abstract values of a per-replica ``tree`` (the leading replica
    axis dropped).

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax.step import _preflight
      >>> _preflight.one_replica({"w": jnp.zeros((8, 3))})
      {'w': ShapeDtypeStruct(shape=(3,), dtype=float32)}
    """
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype), tree)


def abstract(tree: Any) -> Any:
    """``tree``'s leaves as ``jax.ShapeDtypeStruct`` (shape and dtype alone).

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax.step import _preflight
      >>> _preflight.abstract({"w": jnp.zeros((2, 3))})
      {'w': ShapeDtypeStruct(shape=(2, 3), dtype=float32)}
    """
    return jax.tree.map(_abstract, tree)


def check_phases(
    tx: Any,
    mesh: Mesh,
    axes: Sequence[str],
    what: str,
    opt_state: Any,
    params: Any,
    *,
    stand_in: bool = False,
) -> None:
    """Traces ``tx.update`` once per phase inside a ``shard_map`` over ``axes``.

    Args:
      tx: the optimizer (an optax transformation).
      mesh: the step's mesh (Auto axes, or Explicit ones: both trace alike here).
      axes: the data axes, manual inside the ``shard_map``.
      what: the caller's name, for the error.
      opt_state: one replica's optimizer state (no leading replica axis), e.g.
        ``tx.init(probe())``.
      params: one replica's params for ``opt_state`` (abstract values are enough).
      stand_in: ``params`` is a stand-in, not the user's model: a failure of a check
        that depends on the model's shapes (:class:`ModelShapeError`) is skipped.

    Returns:
      None. A failure in code that is not lsgd_jax's is left to the first call's
      trace, which reports it as usual.

    Raises:
      ValueError: a phase cannot run on this mesh or model; says which phase and how to
        fix it. An error of the library's own class (``AxisNotBoundError``,
        :class:`ModelShapeError`) keeps its class.

    Example:
      >>> import numpy as np, jax, optax, lsgd_jax
      >>> from jax.sharding import Mesh
      >>> from lsgd_jax.step import _preflight
      >>> mesh = Mesh(np.array(jax.devices()), ("data",))
      >>> tx = optax.chain(lsgd_jax.post_local_sgd(100), optax.sgd(0.1))
      >>> params = _preflight.probe()
      >>> _preflight.check_phases(tx, mesh, ("data",), "demo", tx.init(params), params)
      Traceback (most recent call last):
      ...
      lsgd_jax._core._collectives.AxisNotBoundError: demo: the optimizer cannot run on this mesh ...
    """
    axes = tuple(axes)
    if not _holds_ours(opt_state):  # DDP: the step's own mean, over its own axes
        return
    manual = frozenset(axes)
    kwargs: dict[str, Any] = {} if manual == frozenset(mesh.axis_names) else {"axis_names": manual}
    abstract = jax.tree.map(_abstract, (opt_state, params))
    for index in range(_phase.num_phases(opt_state)):

        def body(opt_state, params, index=index):
            opt_state, params = jax.tree.map(
                lambda x: _collectives.cast_varying(x, manual), (opt_state, params)
            )
            tx.update(params, _phase.pin(opt_state, index), params)
            return jnp.zeros([])

        traced = jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P(), **kwargs)
        try:
            jax.eval_shape(traced, *abstract)
        except (ValueError, TypeError, NameError, NotImplementedError) as error:
            if not _raised_by_us(error):
                return
            if isinstance(error, ModelShapeError):
                if stand_in:
                    continue  # the user's model decides, at the first call
                where, when = "this model", "before the first step"
            else:
                where, when = f"this mesh (axes {axes})", "when the step is built"
            hint = _hint(opt_state, index, axes)  # the usual case, said plainly
            message = (
                f"{what}: the optimizer cannot run on {where} in phase {index} "
                f"({describe_phase(opt_state, index)}); every phase is checked {when}. "
                f"{hint or error}"
            )
            if hint:  # an axis the mesh lacks, whatever the error said
                raise AxisNotBoundError(message) from error
            raise _same_class(error, message) from error


def _same_class(error: BaseException, message: str) -> BaseException:
    """The library's own class of ``error`` (``AxisNotBoundError``, ``ModelShapeError``,
    each a ValueError too) with ``message``; a ValueError for any other class."""
    if type(error).__module__.startswith("lsgd_jax."):
        try:
            new = type(error)(message)
        except Exception:  # noqa: BLE001  (a class whose constructor wants more)
            return ValueError(message)
        if str(new) == message:
            return new
    return ValueError(message)


def _holds_ours(opt_state: Any) -> bool:
    return bool(sp.states(opt_state))


def _hint(opt_state: Any, index: int, axes: tuple[str, ...]) -> str:
    """The fix for the usual case: the hook's node-local mean in phase ``index`` over
    its default group ``"local"``, which the mesh lacks."""
    if "local" in axes:
        return ""
    for state, digit in _digits(opt_state, index):
        if (
            state.KIND == sp.HOOK
            and digit == 0
            and state.subgroup is None
            and state.post_local_gradient_allreduce
        ):
            return (
                "post_local_sgd averages the gradients inside each node after the switch, "
                "over the mesh axis 'local' by default, and this mesh has none: build it "
                "with a node axis and a local axis (lsgd_jax.make_mesh(num_nodes, "
                "devices_per_node) has ('node', 'local')), or name one node's axis with "
                "post_local_sgd(..., subgroup=<axis>), or pass post_local_gradient_allreduce"
                "=False (no gradient mean after the switch)."
            )
    return ""


def _abstract(x: Any) -> Any:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        x = jnp.asarray(x)
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
