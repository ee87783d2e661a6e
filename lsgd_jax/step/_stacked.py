"""stacked: the transforms on stacked per-replica trees, for plain ``jax.jit`` code.

pjit-style codebases write ``jax.jit`` with shardings and never ``shard_map``. Their
per-replica values are stacked trees (a leading replica axis sharded over the data
axes), which is the layout ``replicate`` makes. The hook and the averagers need the data
axes bound to take their means; ``stacked`` wraps a transformation so that its update
runs in a ``shard_map`` over the data axes (the model axes stay automatic), one replica
per slice: the step counters stay per-replica scalars inside it, so each step's
collectives stay under one conditional. (Written as ``jax.vmap`` over the replicas
instead, the conditionals' predicates would be batched and both branches, with both
collectives, would run on every step.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lsgd_jax import averaging
from lsgd_jax._core import _validate
from lsgd_jax.mesh import check_cpu_threads, data_axes
from lsgd_jax.step import _preflight


def stacked(
    tx: optax.GradientTransformation,
    mesh: Mesh,
    axes: Sequence[str] | None = None,
    *,
    check_order: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """``tx`` for stacked per-replica trees, to call under plain ``jax.jit``.

    ``init(params)`` takes the stacked params (leading replica axis, e.g. from
    :func:`replicate`) and returns the stacked state (the layout of ``replicate(
    tx.init(p), mesh)``); ``update(grads, state, params)`` takes stacked gradients,
    state and params, runs ``tx.update`` once per replica inside a ``shard_map`` over
    the data axes, and returns stacked updates and state. Apply the updates with
    ``optax.apply_updates`` as usual. Nothing else of the step needs ``shard_map``: the
    loss may be mapped over the replica axis with ``jax.vmap`` (see
    ``data_parallel_step(..., lowering="jit")``, which does exactly this).

    On CPU with simulated devices, give XLA's pool two threads a device
    (:func:`simulate_cpu_devices`; "Threads for simulated CPU devices" in
    docs/training_loops.md), and keep at most two steps in flight in your loop.

    Args:
      tx: the optimizer, e.g. ``optax.chain(post_local_sgd(...), optimizer,
        model_averaging(...))``.
      mesh: the mesh; its data axes index the replicas.
      axes: the data-parallel axes; default :func:`data_axes` of ``mesh``.
      check_order: refuse a chain whose ``post_local_sgd`` is not first or whose
        ``model_averaging`` is not last (see :func:`check_configuration`). Like
        :func:`data_parallel_step`, it checks when it is built, before the first step,
        the chain's order and every phase the optimizer will run on this mesh.

    Returns:
      An optax.GradientTransformationExtraArgs on stacked trees.

    Example:
      >>> import jax, jax.numpy as jnp, optax, lsgd_jax
      >>> mesh = lsgd_jax.make_mesh(2, 4)
      >>> tx = lsgd_jax.stacked(optax.chain(lsgd_jax.post_local_sgd(1), optax.sgd(0.5)), mesh)
      >>> params = lsgd_jax.replicate(jnp.zeros(2), mesh)
      >>> state = tx.init(params)
      >>> grads = jnp.arange(8.0)[:, None] * jnp.ones((8, 2))   # replica r: r
      >>> updates, state = jax.jit(tx.update)(grads, state, params)
      >>> updates[:, 0]   # step 0: the global mean, 3.5, on every replica
      Array([-1.75, -1.75, -1.75, -1.75, -1.75, -1.75, -1.75, -1.75], dtype=float32)
    """
    axes = tuple(axes) if axes is not None else data_axes(mesh)
    check_order = _validate.boolean(check_order, "check_order")
    check_cpu_threads(mesh)  # warns once if XLA's CPU pool is too small for the devices
    _preflight.check_tx(tx, mesh, axes, "stacked", check_order)
    rep = P(axes)
    manual = frozenset(axes)
    kwargs: dict[str, Any] = {} if manual == frozenset(mesh.axis_names) else {"axis_names": manual}
    checked: set[Any] = set()  # the models checked (structure, shapes and dtypes)

    def check_model(params: Any, state: Any) -> None:
        key = _preflight.signature(params)
        if key not in checked:
            _preflight.check_model(tx, mesh, axes, "stacked", check_order, params, state)
            checked.add(key)

    def init_fn(params: optax.Params) -> optax.OptState:
        state = jax.vmap(tx.init)(params)
        check_model(params, state)
        offloaded = jax.tree.leaves(state, is_leaf=averaging.is_offloaded)
        if any(averaging.is_offloaded(x) for x in offloaded):
            state = _place_like_replicate(state, mesh, rep)
        return state

    def update_fn(updates, state, params=None, **extra_args):
        inner = optax.with_extra_args_support(tx)
        if params is not None:
            check_model(params, state)

        def body(u, s, p):
            u, s, p = jax.tree.map(lambda x: x[0], (u, s, p))
            u, s = inner.update(u, s, p, **extra_args)
            return jax.tree.map(lambda x: x[None], (u, s))

        mapped = jax.shard_map(
            body, mesh=mesh, in_specs=(rep, rep, rep), out_specs=(rep, rep), **kwargs
        )
        return mapped(updates, state, params)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _place_like_replicate(state: Any, mesh: Mesh, rep: P) -> Any:
    """``state`` laid out as ``replicate`` lays it out: on the mesh, one replica per
    slice, and an offloaded averager's buffers in host memory, where its programs
    expect them (a traced state is left as it is)."""

    def put(x: Any, kind: str | None = None) -> Any:
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            return x
        return jax.device_put(x, NamedSharding(mesh, rep, memory_kind=kind))

    def node(x: Any) -> Any:
        return averaging.place(x, put) if averaging.is_offloaded(x) else put(x)

    return jax.tree.map(node, state, is_leaf=averaging.is_offloaded)
