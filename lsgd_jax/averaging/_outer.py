"""Around a mean: what an average sends, and what is done with its result.

Two of an averager's four parts (when: ``_schedule``; how: ``lsgd_jax.comm``) live here,
each a small value type:

- what travels: :class:`SendParams` (the params) or :class:`SendDelta` (``delta=True``:
  ``params - anchor``, added back to the anchor);
- then: :class:`Assign` (the mean becomes the params) or :class:`OuterStep` (an outer
  optimizer, SlowMo / DiLoCo: a global average becomes an optax step from the anchor on
  the pseudo-gradient ``anchor - mean``).

The anchor is the params at the last global average (per fragment, with fragments). Only
floating leaves take part: integer leaves keep their own values.

Until a fragment's first global average, the replicas' anchors are whatever each was
given to ``init`` and may differ; an average then works from a common anchor, the
group's first replica's (:func:`common_anchor`), so that its members agree afterwards.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from lsgd_jax._core import _collectives
from lsgd_jax._core._collectives import Group, IndexGroups, select


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
    with jax.named_scope("common_anchor"):  # once, until the first global average
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


@dataclasses.dataclass(frozen=True)
class SendParams:
    """What an average sends: the params themselves (PyTorch's behaviour).

    Example:
      >>> from lsgd_jax.averaging._outer import SendParams
      >>> SendParams().send({"w": 2.0}, None)
      {'w': 2.0}
    """

    needs_anchor: ClassVar[bool] = False

    def common_anchor(self, is_global: bool) -> bool:
        """Whether an average at this level must work from a common anchor."""
        del is_global
        return False

    def send(self, values: Any, anchor: Any) -> Any:
        """What travels for ``values``."""
        del anchor
        return values

    def receive(self, mean: Any, anchor: Any, values: Any) -> Any:
        """The averaged values from the mean of what travelled."""
        del anchor, values
        return mean


@dataclasses.dataclass(frozen=True)
class SendDelta:
    """What an average sends: the change since the anchor, ``params - anchor``; the mean
    is added back to the anchor (``delta=True``), so a narrow wire dtype rounds only the
    change. Every level works from a common anchor (see :func:`common_anchor`).

    Example:
      >>> from lsgd_jax.averaging._outer import SendDelta
      >>> SendDelta().send({"w": 2.5}, {"w": 2.0})
      {'w': 0.5}
      >>> SendDelta().receive({"w": 1.0}, {"w": 2.0}, {"w": 2.5})
      {'w': 3.0}
    """

    needs_anchor: ClassVar[bool] = True

    def common_anchor(self, is_global: bool) -> bool:
        """Every level works from a common anchor."""
        del is_global
        return True

    def send(self, values: Any, anchor: Any) -> Any:
        """``values - anchor`` (floating leaves)."""
        return delta_of(values, anchor)

    def receive(self, mean: Any, anchor: Any, values: Any) -> Any:
        """``anchor + mean`` (floating leaves)."""
        return undelta(anchor, mean, values)


@dataclasses.dataclass(frozen=True)
class Assign:
    """Then: the mean becomes the params (PyTorch's behaviour).

    Example:
      >>> from lsgd_jax.averaging._outer import Assign
      >>> Assign().init({"w": 1.0})
      {}
    """

    needs_anchor: ClassVar[bool] = False

    def common_anchor(self, is_global: bool) -> bool:
        """No anchor is needed."""
        del is_global
        return False

    def init(self, anchor: Any) -> dict[str, Any]:
        """The fields this part keeps in the averager's state."""
        del anchor
        return {}

    def apply(
        self, mean: Any, anchor: Any, state: Any, skipped: Any, is_global: bool
    ) -> tuple[Any, Any]:
        """``(new params, state)`` from the averaged params ``mean``."""
        del anchor, skipped, is_global
        return mean, state


@dataclasses.dataclass(frozen=True)
class OuterStep:
    """Then: at a global average, an optax step from the anchor on the pseudo-gradient
    ``anchor - mean`` (SlowMo; DiLoCo with ``optax.sgd(0.7, momentum=0.9,
    nesterov=True)``); other levels assign their mean. See ``outer_step``.

    Attributes:
      optimizer: the outer optax transformation.
      skip_first: the first global average is a plain average that sets the anchor.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from lsgd_jax.averaging._outer import OuterStep
      >>> sorted(OuterStep(optax.sgd(0.7)).init({"w": jnp.ones(2)}))
      ['outer_count', 'outer_state']
    """

    optimizer: Any
    skip_first: bool = True
    needs_anchor: ClassVar[bool] = True

    def common_anchor(self, is_global: bool) -> bool:
        """Without ``skip_first`` the first global step starts from the anchor, which
        must then be common; with it, the first global average is plain."""
        return is_global and not self.skip_first

    def init(self, anchor: Any) -> dict[str, Any]:
        """The outer optimizer's state and the count of global averages."""
        return {
            "outer_state": self.optimizer.init(anchor),
            "outer_count": jnp.zeros([], jnp.int32),
        }

    def apply(
        self, mean: Any, anchor: Any, state: Any, skipped: Any, is_global: bool
    ) -> tuple[Any, Any]:
        """The outer step at a global average; the mean itself at other levels."""
        if not is_global:
            return mean, state
        return outer_step(self.optimizer, self.skip_first, mean, anchor, state, skipped)


class Parts(NamedTuple):
    """An averager as four parts: when, what, how and then (a NamedTuple).

    ``when`` is the schedule (``PeriodicSchedule``, ``HierarchicalSchedule`` or
    ``AdaptiveSchedule``: which calls average, which fragment, and the delay); ``what``
    is ``SendParams()`` or ``SendDelta()``; ``how`` the communication strategy
    (``lsgd_jax.comm``, with its non-finite policy and its own per-replica state);
    ``then`` is ``Assign()`` or ``OuterStep(optimizer)``. ``averager.parts`` gives them,
    ``lsgd_jax.averaging.from_parts`` builds the averager back.

    Example:
      >>> import lsgd_jax
      >>> lsgd_jax.PeriodicModelAverager(4, delta=True).parts.what
      SendDelta()
    """

    when: Any
    what: SendParams | SendDelta
    how: Any
    then: Assign | OuterStep

    @property
    def needs_anchor(self) -> bool:
        """Whether the state keeps an anchor (the params at the last global average)."""
        return self.what.needs_anchor or self.then.needs_anchor

    def common_anchor(self, is_global: bool) -> bool:
        """Whether an average at this level works from a common anchor until its
        fragment's first global average."""
        return self.what.common_anchor(is_global) or self.then.common_anchor(is_global)
