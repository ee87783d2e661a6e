"""Around a global mean: the change since the anchor, and the outer optimizer's step.

The anchor is the params at the last global average (per fragment, with fragments). With
``delta=True`` an average sends ``params - anchor`` and adds the mean back to the anchor;
with an outer optimizer (SlowMo, DiLoCo) a global average becomes an optax step from the
anchor on the pseudo-gradient ``anchor - mean``. Only floating leaves take part: integer
leaves keep their own values.

Until a fragment's first global average, the replicas' anchors are whatever each was
given to ``init`` and may differ; an average then works from a common anchor, the
group's first replica's (:func:`common_anchor`), so that its members agree afterwards.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from lsgd_jax import _collectives
from lsgd_jax._collectives import Group, IndexGroups


def select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """``jnp.where(pred, a, b)`` leaf by leaf, for a scalar ``pred``.

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax import _outer
      >>> _outer.select(jnp.bool_(True), {"a": 1.0}, {"a": 2.0})
      {'a': Array(1., dtype=float32, weak_type=True)}
    """
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def delta_of(values: Any, anchor: Any) -> Any:
    """``values - anchor`` on the floating leaves (integer leaves pass)."""
    return jax.tree.map(lambda v, a: v - a if _collectives.is_averaged(v) else v, values, anchor)


def undelta(anchor: Any, mean: Any, values: Any) -> Any:
    """``anchor + mean`` on the floating leaves; integer leaves keep ``values``."""
    return jax.tree.map(
        lambda a, m, v: a + m if _collectives.is_averaged(v) else v, anchor, mean, values
    )


def _first_members(group: Group) -> jax.Array:
    """Whether this replica is the first of its group (row-major), as a bool scalar."""
    if isinstance(group, IndexGroups):
        table = np.zeros(sum(len(g) for g in group.groups), bool)
        table[[g[0] for g in group.groups]] = True
        return jnp.asarray(table)[lax.axis_index(group.axis_name)]
    return lax.axis_index(group) == 0


def _from_first(anchor: Any, group: Group) -> Any:
    """The group's first replica's floating leaves of ``anchor``, on every member: one
    exact all-reduce (the others send zeros). Integer leaves pass."""
    leaves, treedef = jax.tree.flatten(anchor)
    picked = [i for i, x in enumerate(leaves) if _collectives.is_averaged(x)]
    first = _first_members(group)
    sums = _collectives._psum([jnp.where(first, leaves[i], 0) for i in picked], group)
    for i, s in zip(picked, sums):
        leaves[i] = _collectives.cast_like(s, leaves[i])
    return jax.tree.unflatten(treedef, leaves)


def _typed_common(anchor: Any, values: Any, group: Group) -> bool:
    """Whether the types prove ``anchor`` the same on every member of ``group``: it is
    invariant over the group's axes while the values vary over them (so JAX tracks the
    varying axes here: not under ``pmap`` or ``check_vma=False``)."""
    if isinstance(group, IndexGroups):
        return False
    axes = frozenset(group)
    return all(
        not axes & _collectives.vma(a) and axes <= _collectives.vma(v)
        for a, v in zip(jax.tree.leaves(anchor), jax.tree.leaves(values))
        if _collectives.is_averaged(v)
    )


def common_anchor(anchor: Any, values: Any, group: Group, first: jax.Array) -> Any:
    """The anchor an average over ``group`` works from: ``anchor`` itself once it is
    common, else the group's first replica's.

    ``first`` (a bool scalar from the step counter, the same on every replica): this
    average comes no later than its fragment's first global average, so the replicas'
    anchors are still those given to ``init``, which may differ. The copy from the first
    replica (exact: the anchor itself when every replica was given the same params) is
    one all-reduce inside a ``lax.cond`` on ``first``; none at all when the types prove
    the anchor common (a state shared by the replicas, passed unmapped).
    """
    if _typed_common(anchor, values, group):
        return anchor
    return lax.cond(first, lambda a: _from_first(a, group), lambda a: a, anchor)


def outer_step(
    outer_optimizer: Any,
    skip_first: bool,
    mean: Any,
    anchor: Any,
    state: Any,
    skipped: jax.Array | None,
) -> tuple[Any, Any]:
    """The outer optimizer's step from ``anchor`` on the pseudo-gradient to ``mean``.

    Returns ``(new params, state)`` with the state's ``outer_state`` and ``outer_count``
    advanced: ``anchor + updates``, written as ``mean + (pseudo_grad + updates)`` so that
    ``optax.sgd(1.0)`` gives the mean exactly. With ``skip_first``, the first global
    average (``outer_count == 0``) is the plain mean. A skipped average (``skipped``
    true) leaves the outer state and count as they were.
    """
    pseudo_grad = jax.tree.map(jnp.subtract, anchor, mean)
    updates, outer_state = outer_optimizer.update(pseudo_grad, state.outer_state, anchor)
    stepped = jax.tree.map(
        lambda m, g, u: m + (g + u) if _collectives.is_averaged(m) else m,
        mean,
        pseudo_grad,
        updates,
    )
    outer_state = _collectives.cast_like(outer_state, state.outer_state)
    if skip_first:  # the first global average only sets the anchor
        first = state.outer_count == 0
        stepped = select(first, mean, stepped)
        outer_state = select(first, state.outer_state, outer_state)
    count = optax.safe_increment(state.outer_count)
    if skipped is not None:
        outer_state = select(skipped, state.outer_state, outer_state)
        count = jnp.where(skipped, state.outer_count, count)
    return stepped, state.replace(outer_state=outer_state, outer_count=count)
