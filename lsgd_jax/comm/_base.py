"""What every communication strategy is: the abstract Communication, the Mean it
returns, and apply (a strategy's mean with each leaf's dtype and varying-axes type
given back).
"""

from __future__ import annotations

import abc
import logging
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from lsgd_jax._core import _collectives
from lsgd_jax._core._collectives import Group

logger = logging.getLogger("lsgd_jax")


class Mean(NamedTuple):
    """What a strategy's ``mean`` returns.

    Attributes:
      value: the averaged tree (each leaf in its own dtype and varying-axes type).
      skipped: None when the strategy never skips (a static fact), else a bool scalar,
        the same on every replica of the group: this group kept its own values
        (``value`` is then the input tree).
      state: the strategy's new state (None for stateless strategies).
    """

    value: Any
    skipped: jax.Array | None
    state: Any


class Communication(abc.ABC):
    """How the mean of a pytree over a group of replicas is computed and sent.

    Subclasses are frozen dataclasses (hashable: they are static configuration) that
    implement ``mean``; a strategy that keeps per-replica state (e.g. error feedback)
    also implements ``init``.

    Example:
      >>> import jax.numpy as jnp, lsgd_jax
      >>> strategy = lsgd_jax.comm.quantized(8)
      >>> isinstance(strategy, lsgd_jax.comm.Communication)
      True
      >>> strategy.init({"w": jnp.ones(2)})  # its error-feedback residual, zeros
      {'w': Array([0., 0.], dtype=float32)}
    """

    @abc.abstractmethod
    def mean(
        self, tree: Any, group: Group, state: Any = None, *, cast: bool = True, step: Any = None
    ) -> Mean:
        """The mean of ``tree``'s floating leaves over ``group``.

        Args:
          tree: this replica's values.
          group: a resolved group (a tuple of bound mesh axes, or an IndexGroups).
          state: this strategy's state (from ``init``), or None.
          cast: give each leaf back its own varying-axes type (False keeps the
            collective's narrower type, e.g. invariant for a global mean).
          step: the caller's step count, for log messages.

        Returns:
          A :class:`Mean`.
        """

    @abc.abstractmethod
    def init(self, tree: Any) -> Any:
        """The initial state for values shaped like ``tree``: None unless
        ``keeps_state``, else a state that ``mean`` takes for a ``tree`` of this
        structure (e.g. an error-feedback residual of zeros shaped like it)."""

    @property
    def keeps_state(self) -> bool:
        """Whether this strategy keeps per-replica state between means (error feedback):
        the hook and the averagers then create it with ``init(params)``, pass it to every
        ``mean`` and keep what the mean gives back (default False)."""
        return False

    # What a strategy can do, asked instead of testing for its class (a strategy written
    # elsewhere answers for itself; these are the defaults of an exact mean).

    @property
    def may_skip(self) -> bool:
        """Whether a mean may be skipped for a group (``Mean.skipped``), so that whoever
        averages keeps a record of skips beside the values (default False)."""
        return False

    @property
    def rounds_small_values(self) -> bool:
        """Whether small values next to large ones of the same block may round to zero
        (integers with block scales): values with no error feedback of their own, such as
        Adam's second moments or running variances, must not travel so (default False).
        """
        return False

    def alongside(self) -> Communication:
        """The strategy for values averaged alongside the ones this strategy sends (a
        model's batch statistics next to its params): by default this one.

        Example:
          >>> import lsgd_jax
          >>> lsgd_jax.comm.quantized(4, two_level=True).alongside()  # no block rounding
          TwoLevel(inner_axis='local')
        """
        return self


def initial_state(strategy: Communication, tree: Any) -> Any:
    """``strategy.init(tree)``, checked against what the strategy declares
    (:attr:`Communication.keeps_state`): what the hook and the averagers call.

    Raises:
      TypeError: ``init`` returned a state and ``keeps_state`` is False, or the reverse.
    """
    state = strategy.init(tree)
    if (state is not None) != bool(strategy.keeps_state):
        got = "a state" if state is not None else "None"
        raise TypeError(
            f"{strategy!r}: init returned {got} but keeps_state is {strategy.keeps_state}. A "
            "strategy that keeps per-replica state between means (error feedback) returns "
            "it from init and says so with a keeps_state property that returns True; one "
            "that does not returns None and leaves keeps_state False."
        )
    return state


def apply(
    strategy: Communication,
    tree: Any,
    group: Group,
    state: Any = None,
    *,
    cast: bool = True,
    step: Any = None,
) -> Mean:
    """``strategy.mean(...)``, with each leaf given back its dtype (and, with ``cast``,
    its varying-axes type): what the hook and the averagers call, so that a strategy
    written elsewhere need not restore types itself.

    Args:
      strategy: a :class:`Communication`.
      tree, group, state, cast, step: as for :meth:`Communication.mean`.

    Returns:
      A :class:`Mean`.

    Example:
      >>> import jax, jax.numpy as jnp, lsgd_jax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = lsgd_jax.make_mesh(2, 2)
      >>> f = jax.jit(jax.shard_map(
      ...     lambda x: lsgd_jax.comm.apply(lsgd_jax.comm.flat(), x, ("node", "local")).value,
      ...     mesh=mesh, in_specs=P(("node", "local")), out_specs=P(("node", "local"))))
      >>> f(jnp.arange(4.0))
      Array([1.5, 1.5, 1.5, 1.5], dtype=float32)
    """
    out = strategy.mean(tree, group, state, cast=cast, step=step)
    value = jax.tree.map(lambda v, x: jnp.asarray(v).astype(jnp.result_type(x)), out.value, tree)
    if cast:
        value = _collectives.cast_tree_like(value, tree)
    return Mean(value, out.skipped, out.state)
