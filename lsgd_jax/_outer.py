"""Around a global mean: the change since the anchor, and the outer optimizer's step.

The anchor is the params at the last global average (per fragment, with fragments). With
``delta=True`` an average sends ``params - anchor`` and adds the mean back to the anchor;
with an outer optimizer (SlowMo, DiLoCo) a global average becomes an optax step from the
anchor on the pseudo-gradient ``anchor - mean``. Only floating leaves take part: integer
leaves keep their own values.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from lsgd_jax import _collectives


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
