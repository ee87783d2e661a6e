"""check_configuration: how the hook and the averagers of one optimizer fit together.

Each transform checks its own arguments; what only shows when they meet is checked here,
from the static metadata of an optimizer state: the order of the chain, a warm-up that
does not match the hook's switch, and an averaging level that can only average replicas
the hook already keeps identical.
"""

from __future__ import annotations

import warnings
from typing import Any

from lsgd_jax._core import _collectives
from lsgd_jax._core import _state_protocol as sp
from lsgd_jax.hook import DEFAULT_SUBGROUP
from lsgd_jax.step import _chain_order


def has_hook(opt_state: Any) -> bool:
    """Whether ``opt_state`` holds a PostLocalSGDState (a post_local_sgd hook)."""
    return bool(sp.states(opt_state, sp.HOOK))


def _redundant_levels(hook: Any, averager: Any) -> list[Any]:
    """The averager's groups that lie inside the hook's gradient-averaging subgroup."""
    if not hook.post_local_gradient_allreduce:
        return []
    subgroup = hook.subgroup if hook.subgroup is not None else DEFAULT_SUBGROUP
    return [g for g in averager.groups if g is not None and _collectives.group_covers(g, subgroup)]


def check_configuration(opt_state: Any, *, check_order: bool = True, tx: Any = None) -> None:
    """Checks how the post-local SGD pieces of an optimizer state fit together.

    Raises when ``model_averaging`` (or ``post_local_sgd_optimizer``) comes before
    ``post_local_sgd``, and, with ``check_order``, when anything comes before the hook or
    after the averaging in its chain (nested chains and wrappers such as
    ``optax.MultiSteps`` are seen through). Warns, once per configuration, when an
    averager's ``warmup_steps`` differs from the hook's ``start_localSGD_iter``, and when
    an averaging level's group lies inside the hook's subgroup (its all-reduce changes
    nothing). :func:`data_parallel_step` calls it; call it on the state of a hand-written
    step (it reads static metadata only). Why each rule: docs/options_in_depth.md.

    Args:
      opt_state: an optax state holding PostLocalSGDState / ModelAveragerState nodes
        (per-replica or not), or a ``flax.nnx.Optimizer`` (its ``opt_state`` is read).
      check_order: whether to refuse a hook that is not first, or a model averaging that
        is not last, in its chain (False: an order composed on purpose; an averager
        before the hook is refused either way).
      tx: the optimizer whose state this is, if you have it, to tell ``optax.chain``'s
        tuples from a wrapper's (without it, some misorders go unseen).

    Returns:
      None.

    Raises:
      TypeError: an NNX ``State`` of an optimizer (``nnx.state(optimizer)``), which
        has lost the states: pass ``optimizer.opt_state``.
      ValueError: a model averager comes before the hook; or, with ``check_order``, the
        hook is not first or the averaging not last (naming the order found and wanted).

    Example:
      >>> import optax, lsgd_jax
      >>> tx = optax.chain(lsgd_jax.post_local_sgd(8), optax.sgd(0.1),
      ...     lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(4, warmup_steps=8)))
      >>> lsgd_jax.check_configuration(tx.init({}))

      The optimizer before the hook would average Adam's updates, not the gradients:

      >>> bad = optax.chain(optax.adam(1e-3), lsgd_jax.post_local_sgd(8))
      >>> lsgd_jax.check_configuration(bad.init({}))
      Traceback (most recent call last):
      ...
      ValueError: post_local_sgd must come first in the optax.chain, but it sits at position 1 ...
    """
    opt_state = sp.read_through(opt_state)  # an nnx.Optimizer: its optax state
    nodes: list[Any] = sp.states(opt_state)  # hooks' and averagers' states
    hooks = [(i, x) for i, x in enumerate(nodes) if x.KIND == sp.HOOK]
    averagers = [
        (i, x.averager)
        for i, x in enumerate(nodes)
        if x.KIND == sp.AVERAGER and x.averager is not None
    ]
    if hooks and averagers and averagers[0][0] < hooks[0][0]:
        raise ValueError(
            f"{type(averagers[0][1]).__name__} comes before post_local_sgd in the optimizer "
            "chain, so it would average the raw gradients' updates, which the hook and the "
            "optimizer then rescale: no model average would land. Put post_local_sgd first "
            "and model_averaging (or post_local_sgd_optimizer) last: optax.chain("
            "lsgd_jax.post_local_sgd(...), optimizer, lsgd_jax.model_averaging(...))."
        )
    if check_order:
        _chain_order.check(opt_state, tx)
    for _, hook in hooks:
        for _, averager in averagers:
            name = type(averager).__name__
            if averager.warmup_steps != hook.start_localSGD_iter:
                warnings.warn(
                    f"{name} has warmup_steps={averager.warmup_steps} but post_local_sgd has "
                    f"start_localSGD_iter={hook.start_localSGD_iter}: models are then "
                    "averaged while gradients are still averaged globally, or local SGD runs "
                    "without model averages. PyTorch's pairing sets both to the same step.",
                    stacklevel=2,
                )
            for group in _redundant_levels(hook, averager):
                warnings.warn(
                    f"{name} averages over {group!r}, inside the subgroup over which "
                    "post_local_sgd keeps averaging gradients after the switch, so those "
                    "replicas are already identical: that all-reduce costs time and changes "
                    "nothing. Drop that level, or pass post_local_gradient_allreduce=False "
                    "to post_local_sgd (local SGD inside the node too).",
                    stacklevel=2,
                )
