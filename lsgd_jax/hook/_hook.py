"""post_localSGD_hook and the ``post_local_sgd`` optax transformation."""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax import lax

from lsgd_jax import comm
from lsgd_jax._core import _collectives
from lsgd_jax._core._collectives import GroupSpec
from lsgd_jax.hook._state import PostLocalSGDState, keeps_residual

DEFAULT_SUBGROUP = ("local",)


def _default_subgroup() -> Any:
    """``"local"`` where bound; under a single (pmap) axis, the process layout."""
    bound = _collectives.bound_axes()
    if DEFAULT_SUBGROUP[0] not in bound and len(bound) == 1:
        if lax.axis_size(bound[0]) == jax.device_count():
            return _collectives.node_groups(bound[0])
    return DEFAULT_SUBGROUP


def _groups(state: PostLocalSGDState) -> tuple[Any, Any]:
    what = "post_localSGD_hook"
    global_group = _collectives.resolve(
        state.process_group, _collectives.global_axes(what), what + " (process_group)"
    )
    subgroup = None
    if state.post_local_gradient_allreduce:
        subgroup = _collectives.resolve(state.subgroup, _default_subgroup, what + " (subgroup)")
    return global_group, subgroup


def post_localSGD_hook(state: PostLocalSGDState, grads: Any) -> tuple[Any, PostLocalSGDState]:
    """Averages gradients globally until ``start_localSGD_iter``, then inside the node.

    The JAX form of PyTorch's ``post_localSGD_hook``: while ``state.iter <
    state.start_localSGD_iter`` it takes the mean of ``grads`` over ``process_group`` and
    advances ``iter``; from then on the mean over ``subgroup`` (or ``grads`` untouched when
    ``post_local_gradient_allreduce`` is False), and ``iter`` stays put. One ``lax.cond``
    on the step count picks exactly one of the collectives. Call it inside
    ``jax.shard_map`` or ``jax.pmap`` (not ``jax.vmap`` over replicas: that runs both).
    Only floating leaves are averaged, each keeping its dtype and varying-axes type.
    ``state.communication`` sends the means (error feedback: docs/options_in_depth.md).

    Args:
      state: a PostLocalSGDState, with the same ``iter`` on every replica; with an
        error-feedback strategy, one per replica, made by ``state.init(params)``.
      grads: any pytree of gradients (this replica's).

    Returns:
      ``(grads, new_state)``: the averaged gradients and the next state (with this
      replica's new residual, under error feedback).

    Raises:
      TypeError: ``state`` is not a PostLocalSGDState.
      ValueError: its strategy keeps a residual and ``state`` has none.

    Example:
      >>> import jax, jax.numpy as jnp, lsgd_jax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = lsgd_jax.make_mesh(num_nodes=2, devices_per_node=2)
      >>> state = lsgd_jax.PostLocalSGDState(None, "local", start_localSGD_iter=1)
      >>> def step(state, g):
      ...     g, state = lsgd_jax.post_localSGD_hook(state, g)
      ...     return state, g
      >>> f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(("node", "local"))),
      ...                           out_specs=(P(), P(("node", "local")))))
      >>> g = jnp.arange(4.0)
      >>> state, out = f(state, g)   # before the switch: the mean over all 4
      >>> out
      Array([1.5, 1.5, 1.5, 1.5], dtype=float32)
      >>> state, out = f(state, g)   # after: the mean inside each node of 2
      >>> out
      Array([0.5, 0.5, 2.5, 2.5], dtype=float32)
    """
    _check_state(state)
    global_group, subgroup = _groups(state)
    communication = state.communication or comm.flat()

    def mean(grads, state, group):
        out = comm.apply(communication, grads, group, state.comm_state, step=state.iter)
        if state.comm_state is None:
            return out.value, state
        return out.value, state.replace(comm_state=_residual_like(out.state, state.comm_state))

    def global_step(grads, state):
        grads, state = mean(grads, state, global_group)
        return grads, state.maybe_increase_iter()

    def local_step(grads, state):
        if subgroup is None:
            return grads, state
        return mean(grads, state, subgroup)

    with jax.named_scope("post_localSGD_hook"):  # names its collectives in the HLO
        if state.start_localSGD_iter == 0:  # static: local from the first step, no cond
            return local_step(grads, state)
        if state.pinned_phase is not None:  # a step specialized per phase (static)
            return (global_step if state.pinned_phase else local_step)(grads, state)
        return lax.cond(state.phase > 0, global_step, local_step, grads, state)


def _check_state(state: Any) -> None:
    """A PostLocalSGDState, with a residual where its strategy keeps error feedback."""
    if not isinstance(state, PostLocalSGDState):
        raise TypeError(
            f"post_localSGD_hook expects a PostLocalSGDState as its first argument, got "
            f"{type(state).__name__}; create one with lsgd_jax.PostLocalSGDState(...)."
        )
    if state.comm_state is None and keeps_residual(state.communication):
        raise ValueError(
            f"post_localSGD_hook: {state.communication!r} keeps an error-feedback residual "
            "shaped like the gradients in the hook's state, and this state has none: "
            "create it with state.init(params) (post_local_sgd(...).init(params) does), "
            "or use error_feedback=False."
        )


def _residual_like(new: Any, old: Any) -> Any:
    """The strategy's new residual typed like the state's (so both cond branches agree).

    A residual is per replica; one held by a state shared by every replica (passed
    unmapped) cannot take it, which is said here rather than as a type error of JAX's.
    """
    for x, y in zip(jax.tree.leaves(new), jax.tree.leaves(old)):
        extra = _collectives.vma(x) - _collectives.vma(y)
        if extra:
            raise ValueError(
                "post_localSGD_hook: the error-feedback residual (state.comm_state) differs "
                f"between replicas (over {sorted(extra, key=str)}), but this state is "
                "shared by them: pass the hook's state per replica, with a leading replica "
                "axis sharded over the data axes (lsgd_jax.replicate(state, mesh) and that "
                "axis in the shard_map in_specs and out_specs; data_parallel_step does this)."
            )
    return _collectives.cast_like(new, old)


def post_local_sgd(
    start_localSGD_iter: int,
    *,
    process_group: GroupSpec = None,
    subgroup: GroupSpec = None,
    post_local_gradient_allreduce: bool = True,
    communication: comm.Communication | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Post-local SGD gradient averaging as an optax transformation.

    Put it first in ``optax.chain``: each replica's gradients become their mean over all
    replicas for ``start_localSGD_iter`` steps, then their mean inside the node (see
    :func:`post_localSGD_hook`); its state is a :class:`PostLocalSGDState`. Pair it with
    :func:`model_averaging` last, ``warmup_steps == start_localSGD_iter``. Under
    ``optax.MultiSteps`` it counts optimizer updates, not mini-batches.

    Args:
      start_localSGD_iter: steps of global averaging before local SGD starts (>= 0).
      process_group: the global group's axes; None: every mapped axis bound where it runs.
      subgroup: one node's axes; None: ``"local"``. An IndexGroups under ``jax.pmap``.
      post_local_gradient_allreduce: False: no gradient mean after the switch (local SGD).
      communication: how the gradient means travel, a ``lsgd_jax.comm`` strategy; None:
        one all-reduce (``comm.flat()``, PyTorch's). With error feedback
        (``comm.quantized()``) ``init`` needs the params.

    Returns:
      An optax.GradientTransformationExtraArgs.

    Raises:
      TypeError: an argument of the wrong type (named, with the fix).
      ValueError: a bad value, e.g. a negative ``start_localSGD_iter``.

    Example:
      >>> import optax, lsgd_jax
      >>> tx = optax.chain(
      ...     lsgd_jax.post_local_sgd(start_localSGD_iter=100),
      ...     optax.sgd(0.1, momentum=0.9),
      ...     lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(8, warmup_steps=100)),
      ... )

      The warm-up's global means sent across nodes as int8, with error feedback:

      >>> import jax.numpy as jnp
      >>> hook = lsgd_jax.post_local_sgd(
      ...     100, communication=lsgd_jax.comm.quantized(8, two_level=True))
      >>> hook.init({"w": jnp.ones(3)}).comm_state
      {'w': Array([0., 0., 0.], dtype=float32)}

    References:
      Lin, Stich, Patel, Jaggi, `Don't Use Large Mini-Batches, Use Local SGD
      <https://arxiv.org/abs/1808.07217>`_, ICLR 2020.
    """
    # Validate eagerly (the state constructor checks and logs once, here).
    template = PostLocalSGDState(
        process_group,
        subgroup,
        start_localSGD_iter,
        post_local_gradient_allreduce,
        communication=communication,
    )

    def init_fn(params: optax.Params) -> PostLocalSGDState:
        return template.init(params)

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        return post_localSGD_hook(state, updates)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
