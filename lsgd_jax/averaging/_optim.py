"""The averagers as optax transformations: model_averaging, post_local_sgd_optimizer."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax

from lsgd_jax._core import _collectives
from lsgd_jax._core._struct import Struct, pytree_dataclass
from lsgd_jax.averaging import _average_call
from lsgd_jax.averaging._averager_state import ModelAveragerState, check_state
from lsgd_jax.averaging._averaging import Averager, check_averager


def averaged_updates(
    averager: Averager, updates: Any, params: Any, state: ModelAveragerState, extra: Any = None
) -> tuple[Any, Any, ModelAveragerState]:
    """Updates that move ``params`` to the group mean on the steps that average.

    On an averaging step, ``u`` becomes ``mean(params + u) - params`` and ``extra`` its
    group mean (in the same collective); otherwise both pass through unchanged. The
    addition, the collective and the subtraction sit inside the taken branch only.

    Returns:
      ``(updates, extra, new_state)``.
    """
    check_state(state, "model_averaging", averager)

    def prepare(op):
        u, p, e = op
        new = jax.tree.map(lambda pi, ui: jnp.asarray(pi + ui).astype(jnp.result_type(pi)), p, u)
        return new, e

    def finish(op, new, e_mean):
        u, p, _ = op
        out = jax.tree.map(
            lambda ni, pi, ui: (
                (ni - pi).astype(jnp.result_type(ui)) if _collectives.is_averaged(ui) else ui
            ),
            new,
            p,
            u,
        )
        return _collectives.cast_tree_like(out, u, p), e_mean

    def passthrough(op):
        u, p, e = op
        return _collectives.cast_tree_like(u, u, p), e

    (updates, extra), state = _average_call.run(
        averager, (updates, params, extra), state, prepare, finish, passthrough
    )
    return updates, extra, averager._advance(state)


def _require_params(params: Any, what: str) -> None:
    if params is None:
        raise ValueError(
            f"{what} needs the current params: call tx.update(grads, opt_state, params) "
            "(optax's third argument)."
        )


def model_averaging(averager: Averager) -> optax.GradientTransformationExtraArgs:
    """Model averaging as the last transformation of an ``optax.chain``.

    On the steps where ``averager`` averages, the incoming updates ``u`` are replaced by
    ``mean(params + u) - params`` (the mean over the averager's group), so that
    ``optax.apply_updates`` moves every replica to the group mean; on other steps ``u``
    passes through unchanged, and the addition, the collective and the subtraction all
    sit inside the untaken branch of a ``lax.cond``/``lax.switch``.

    This path is exact only up to rounding: ``apply_updates`` adds ``params + (mean -
    params)``, which need not equal ``mean`` in floating point, so replicas can differ in
    the last bit after an average. For bitwise-identical replicas call
    ``averager.average_parameters(params, state)`` after ``optax.apply_updates`` instead.

    Its state is the averager's ModelAveragerState, initialized with the params (which
    the averager's options for an outer optimizer or delta averaging need).

    Args:
      averager: a PeriodicModelAverager or HierarchicalModelAverager.

    Returns:
      An optax.GradientTransformationExtraArgs whose state is a ModelAveragerState; its
      update requires ``params``.

    Example:
      >>> import optax, lsgd_jax
      >>> tx = optax.chain(
      ...     lsgd_jax.post_local_sgd(start_localSGD_iter=10),
      ...     optax.adamw(1e-3),
      ...     lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(4, warmup_steps=10)),
      ... )
    """
    check_averager(averager, "model_averaging")

    def init_fn(params: optax.Params) -> ModelAveragerState:
        return averager.init(params)

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        _require_params(params, "model_averaging")
        updates, _, state = averaged_updates(averager, updates, params, state)
        return updates, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@pytree_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class PostLocalSGDOptimizerState(Struct):
    """The state of :func:`post_local_sgd_optimizer`.

    Attributes:
      inner_state: the wrapped optimizer's state (never averaged, unless chosen with
        ``average_opt_state``).
      averager_state: the averager's ModelAveragerState; restoring it from a checkpoint
        keeps the averaging schedule (no second warm-up).
    """

    inner_state: optax.OptState
    averager_state: ModelAveragerState


def _check_opt_state_communication(averager: Averager, average_opt_state: Any) -> None:
    """Refuses ``average_opt_state`` with a quantized communication: its leaves would be
    quantized in blocks, with no error feedback of their own."""
    strategy = averager.communicator
    if average_opt_state is None or not strategy.rounds_small_values:
        return
    raise ValueError(
        f"post_local_sgd_optimizer: average_opt_state cannot travel with a quantized "
        f"communication ({strategy!r}): the chosen optimizer-state leaves would be rounded "
        "to small integers in blocks scaled by each block's largest value, "
        "with no error feedback of their own, so small entries round to 0 (Adam's second "
        "moments: a zeroed entry turns the next update of that parameter into lr * m / "
        "eps). Average them with an exact or bfloat16 communication (communication="
        "lsgd_jax.comm.flat(), lsgd_jax.comm.finite_only(...) or lsgd_jax.comm.compressed("
        "jnp.bfloat16)), or keep them local (average_opt_state=None)."
    )


def post_local_sgd_optimizer(
    optim: optax.GradientTransformation,
    averager: Averager,
    *,
    average_opt_state: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """The optax form of PyTorch's ``PostLocalSGDOptimizer``: step, then average.

    Runs ``optim``, then :func:`model_averaging` with ``averager`` on the result. Its
    state holds the inner optimizer's state (which is never averaged, as in PyTorch) and
    the averager's step, so a restored checkpoint resumes the averaging schedule instead
    of redoing the warm-up. Use it after :func:`post_local_sgd` in an ``optax.chain``.

    Beyond PyTorch, ``average_opt_state`` also averages chosen leaves of the inner
    optimizer's state (momentum buffers, Adam moments), on the same steps, over the same
    group and in the same collective as the params: replicas' momenta otherwise drift
    apart between averages (PyTorch issues #59699, #74157).

    Args:
      optim: the local optimizer (any optax GradientTransformation).
      averager: a PeriodicModelAverager or HierarchicalModelAverager.
      average_opt_state: which inner-state leaves to average: None (none, PyTorch's
        behaviour), a pytree of bools shaped like the inner state (an optax-style mask),
        or a callable ``inner_state -> that pytree``, e.g.
        ``lambda s: jax.tree.map(lambda x: jnp.ndim(x) > 0, s)`` (every array but the
        scalar counters). With ``fragments``, chosen parts shaped like the params
        (momentum, Adam's moments, also with some of their leaves left out by the
        mask) are averaged element by element with their params; other chosen leaves
        are averaged whole at every fragment's average. Not with a
        quantized communication (``comm.quantized``: ValueError at construction): its
        blocks would round small entries, such as Adam's second moments, to 0.

    Returns:
      An optax.GradientTransformationExtraArgs with a PostLocalSGDOptimizerState.

    Example:
      >>> import optax, lsgd_jax
      >>> tx = optax.chain(
      ...     lsgd_jax.post_local_sgd(start_localSGD_iter=100),
      ...     lsgd_jax.post_local_sgd_optimizer(
      ...         optax.sgd(0.1, momentum=0.9),
      ...         lsgd_jax.PeriodicModelAverager(period=4, warmup_steps=100)),
      ... )
    """
    check_averager(averager, "post_local_sgd_optimizer")
    if averager.delay and average_opt_state is not None:
        raise ValueError(
            f"post_local_sgd_optimizer: average_opt_state is not supported with a delayed "
            f"average (delay={averager.delay}): the optimizer state would land on other "
            "steps than the params. Use delay=0 or average_opt_state=None."
        )
    _check_opt_state_communication(averager, average_opt_state)
    inner = optax.with_extra_args_support(optim)

    def mask_of(inner_state):
        if average_opt_state is None:
            return [False] * len(jax.tree.leaves(inner_state))
        mask = average_opt_state(inner_state) if callable(average_opt_state) else average_opt_state
        leaves, treedef = jax.tree.flatten(inner_state)
        try:
            flags = cast(Any, treedef).flatten_up_to(mask)  # not in jax's type stubs
        except (ValueError, TypeError) as e:
            raise ValueError(
                "average_opt_state must be a pytree of bools with the structure of the inner "
                f"optimizer's state ({treedef}), or a callable returning one."
            ) from e
        return [bool(f) for f in flags]

    def init_fn(params: optax.Params) -> PostLocalSGDOptimizerState:
        inner_state = inner.init(params)
        mask_of(inner_state)  # validate the mask eagerly
        return PostLocalSGDOptimizerState(inner_state, averager.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        _require_params(params, "post_local_sgd_optimizer")
        updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        flags = mask_of(inner_state)
        leaves, treedef = jax.tree.flatten(inner_state)
        # The chosen leaves, in the inner state's own structure (None elsewhere), so that
        # its params-shaped parts (momentum, moments) can be cut like the params.
        extra = jax.tree.unflatten(treedef, [x if f else None for x, f in zip(leaves, flags)])
        updates, extra, averager_state = averaged_updates(
            averager, updates, params, state.averager_state, extra if any(flags) else None
        )
        if any(flags):
            it = iter(jax.tree.leaves(extra))
            leaves = [next(it) if f else x for x, f in zip(leaves, flags)]
            inner_state = jax.tree.unflatten(treedef, leaves)
        return updates, PostLocalSGDOptimizerState(inner_state, averager_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
