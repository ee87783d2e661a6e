"""What a step checks when it is built: every phase of the optimizer, traced on the mesh.

A step specialized per phase traces a phase's program when that phase first occurs: a
node-local mean after the switch (step 100, or 10,000), a hierarchical level's average,
a two-level strategy's inner axis. A mesh that one of them cannot use would then fail
hours into a run. So when the step is built, the optimizer's update is traced (not
compiled, not run) once per phase on a one-value tree, inside a ``shard_map`` over the
step's data axes: every group resolves and every collective is typed as in the real
step, and what fails is reported with the phase and the fix, before the first step.

Only errors raised by lsgd_jax itself are reported: a failure of the probe in the user's
own transformations (one that needs the real params' structure, e.g. ``optax.masked``
with a mask tree) leaves the check to the first call, whose trace reports it as usual.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from lsgd_jax._core import _collectives
from lsgd_jax._core import _state_protocol as sp
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


def check_tx(tx: Any, mesh: Mesh, axes: Sequence[str], what: str, check_order: bool) -> Any:
    """The checks a step runs when it is built, from ``tx`` alone: the chain's order
    (``check_configuration``) and every phase on the mesh (:func:`check_phases`), on
    ``tx.init`` of a one-value probe tree.

    Args:
      tx: the optimizer.
      mesh: the step's mesh.
      axes: its data axes.
      what: the caller's name, for errors.
      check_order: whether to refuse a hook not first or an averaging not last.

    Returns:
      The probe's optimizer state, or None where ``tx.init`` needs the real params'
      structure (e.g. ``optax.masked`` with a mask tree): the first trace checks then.

    Example:
      >>> import optax, lsgd_jax
      >>> from lsgd_jax.step import _preflight
      >>> tx = optax.chain(lsgd_jax.post_local_sgd(8), optax.sgd(0.1))
      >>> state = _preflight.check_tx(tx, lsgd_jax.make_mesh(2, 4), ("node", "local"),
      ...     "demo", check_order=True)
      >>> lsgd_jax.num_phases(state)
      2
    """
    try:
        params = probe()
        probe_state = tx.init(params)
    except Exception:  # noqa: BLE001  (a transform needing the real params' structure)
        return None
    _pairing.check_configuration(probe_state, check_order=check_order)
    check_phases(tx, mesh, axes, what, probe_state, params)
    return probe_state


def check_phases(
    tx: Any,
    mesh: Mesh,
    axes: Sequence[str],
    what: str,
    opt_state: Any,
    params: Any,
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

    Returns:
      None. A failure in code that is not lsgd_jax's is left to the first call's
      trace, which reports it as usual.

    Raises:
      ValueError: a phase cannot run on this mesh; says which phase and how to fix it.

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
      ValueError: demo: the optimizer cannot run on this mesh (axes ('data',)) in phase 0 ...
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
            hint = _hint(opt_state, index, axes)  # the usual case, said plainly
            raise ValueError(
                f"{what}: the optimizer cannot run on this mesh (axes {axes}) in phase "
                f"{index} ({describe_phase(opt_state, index)}); every phase is checked "
                f"when the step is built. {hint or error}"
            ) from error


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
    x = jnp.asarray(x) if not isinstance(x, jax.ShapeDtypeStruct) else x
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
