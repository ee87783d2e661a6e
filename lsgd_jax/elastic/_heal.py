"""Moving per-replica state onto a new membership's mesh, and healing joiners.

Nothing leaves a process when the mesh changes: each device keeps its own replica's
values (with one replica a process, sharded over its devices, a device whose position
in its row changed gets the shard of its new position from the local device that held
it), and a new global array is assembled from the local shards
(``jax.make_array_from_single_device_arrays``). A process that joins has no state of
its own; one collective program gives its replicas the survivors' consensus params
and model state, if any (their mean), and one live replica's optimizer state and
counters (but a zero error-feedback residual: that one belongs to the replica whose
rounding it kept).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lsgd_jax._core import _state_protocol as sp
from lsgd_jax._core._replicas import num_replicas, replica_spec


def reshard(tree: Any, mesh: Mesh, axes: tuple[str, ...], inside: tuple[str, ...] = ()) -> Any:
    """The same per-replica values, as global arrays over ``mesh``.

    Each replica stays on the devices that hold it: one device each, or with ``inside``
    (FSDP axes: a replica spans the devices of one process) this process's devices,
    which may take other positions in the new mesh's rows; a device then gets the
    shard of its new position from the local device that held it (no copy when that
    is itself).

    Args:
      tree: arrays with a leading replica axis over an earlier mesh that holds these
        devices, laid out as :func:`lsgd_jax.replicate` lays them out with
        ``shard_over=inside``.
      mesh: the new mesh; this process's devices must be among its devices.
      axes: the mesh axes the replica axis is split over.
      inside: the FSDP axes inside each replica (none: one replica per device).

    Returns:
      The tree over ``mesh``.

    Example:
      >>> import jax, numpy as np
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> from lsgd_jax.elastic._heal import reshard
      >>> d = jax.devices()[:2]
      >>> a = Mesh(np.array(d).reshape(2, 1), ("node", "local"))
      >>> b = Mesh(np.array(d[::-1]).reshape(2, 1), ("node", "local"))  # rows swapped
      >>> x = jax.device_put(np.array([0.0, 1.0]), NamedSharding(a, P(("node", "local"))))
      >>> reshard({"w": x}, b, ("node", "local"))["w"]  # each device kept its value
      Array([1., 0.], dtype=float32)
    """
    n = num_replicas(mesh, axes)

    def one(x):
        shape = (n, *x.shape[1:])
        sharding = NamedSharding(mesh, replica_spec(x.shape[1:], mesh, axes, inside))
        wanted = sharding.addressable_devices_indices_map(shape)
        old = {s.device: _bounds(s.index, x.shape) for s in x.addressable_shards}
        data = {s.device: s.data for s in x.addressable_shards}
        local = []
        for d in sharding.addressable_devices:
            index = wanted[d]
            assert index is not None  # an addressable device's
            # d keeps its replica; the slice inside it is the one of its new position
            want = old[d][:1] + _bounds(index[1:], shape[1:])
            if old[d] == want:  # d holds it already (always, with whole leaves)
                local.append(data[d])
                continue
            held = next(e for e, b in old.items() if b == want)
            local.append(jax.device_put(data[held], d))
        return jax.make_array_from_single_device_arrays(shape, sharding, local)

    return jax.tree.map(one, tree)


def _bounds(index: tuple[Any, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A shard's index (slices) as ``(start, stop)`` per dimension of ``shape``."""
    return tuple(sl.indices(dim)[:2] for sl, dim in zip(index, shape))


def local_flags(mesh: Mesh, axes: tuple[str, ...], value: bool) -> jax.Array:
    """A per-replica bool array over ``mesh``: ``value`` on every replica of this process."""
    sharding = NamedSharding(mesh, P(axes))
    n = num_replicas(mesh, axes)

    def fill(idx: Any) -> np.ndarray:
        return np.full(len(range(n)[idx[0]]), value)

    return jax.make_array_from_callback((n,), sharding, fill)


def _heal_program(mesh: Mesh, axes: tuple[str, ...], specs: Any = None):
    """The program that heals ``(params, opt_state)`` laid out by ``specs`` (their
    arrays' partition specs, e.g. FSDP shards inside a replica; default ``P(axes)``
    for both: one replica a device)."""
    spec = P(axes)
    specs = (spec, spec) if specs is None else specs

    def body(params, opt_state, joining, source):
        keep = (~joining).astype(jnp.float32)  # (1,): this replica's weight in the mean
        n = jax.lax.psum(keep, axes)

        def mean(x):
            if not jnp.issubdtype(x.dtype, jnp.inexact):
                return pick(x)
            w = keep.reshape((1,) + (1,) * (x.ndim - 1))
            acc = jax.lax.psum(x.astype(jnp.float32) * w, axes) / n.reshape(w.shape)
            return jnp.where(joining.reshape(w.shape), acc.astype(x.dtype), x)

        def pick(x):
            s = source.reshape((1,) + (1,) * (x.ndim - 1))
            got = jax.lax.psum(jnp.where(s, x, jnp.zeros_like(x)), axes)
            return jnp.where(joining.reshape(s.shape), got, x)

        def residual(x):
            # A residual (error feedback) is what rounding took from THIS replica's
            # params; a joiner's params are the survivors' mean, so its residual starts
            # at zero rather than as a copy of another replica's.
            zero = jnp.zeros_like(x)
            return jnp.where(joining.reshape((1,) + (1,) * (x.ndim - 1)), zero, x)

        leaves, treedef = jax.tree.flatten(opt_state)
        healed = [
            residual(x) if role == sp.RESIDUAL else pick(x)
            for x, role in zip(leaves, sp.leaf_roles(opt_state), strict=True)
        ]
        return jax.tree.map(mean, params), jax.tree.unflatten(treedef, healed)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(*specs, spec, spec), out_specs=specs))


def heal(
    params: Any, opt_state: Any, mesh: Mesh, axes: tuple[str, ...], joining: bool, source: bool
) -> tuple[Any, Any]:
    """Joiners' replicas take the survivors' mean params and one survivor's state.

    Every process of the mesh calls it (a collective).

    Args:
      params, opt_state: per-replica trees over ``mesh`` (a joiner's are placeholders of
        the right shapes, e.g. a fresh init). ``params`` is any tree that is healed by
        the mean, e.g. ``(params, model_state)``.
      mesh, axes: the membership's mesh and its data axes.
      joining: whether this process is joining.
      source: whether this process's first replica is the one whose optimizer state
        the joiners copy (exactly one process says True; never a joiner).

    Returns:
      ``(params, opt_state)``: survivors' replicas unchanged.
    """
    join = local_flags(mesh, axes, joining)
    sharding = NamedSharding(mesh, P(axes))
    n = num_replicas(mesh, axes)
    first: Any = sharding.addressable_devices_indices_map((n,))
    lowest = min(idx[0].start or 0 for idx in first.values())

    def src(idx: Any) -> np.ndarray:
        start = idx[0].start or 0
        return np.array([source and start == lowest])

    pick = jax.make_array_from_callback((n,), sharding, src)
    specs = jax.tree.map(lambda x: x.sharding.spec, (params, opt_state))
    return _heal_program(mesh, axes, specs)(params, opt_state, join, pick)
