"""A mean sent as small integers with per-block scales, and the error feedback it keeps.

The floating leaves go into one flat float32 buffer (``_wire.pack``), cut into one chunk
per replica, and each chunk into blocks of up to ``block_size`` values (a block never
longer than a chunk, so padding follows the data). A block travels as ``q = round(x /
s)`` in ``[-qmax, qmax]`` with ``s = max|x| / qmax`` (``qmax`` 127 for 8 bits, 7 for 4
bits, two values per byte), so each value is off by at most ``s / 2``. The mean is two
exchanges of integers:

1. an ``all_to_all`` hands each replica its chunk from every peer, its own included,
   quantized alike (nobody's values are special); it dequantizes, sums in float32 and
   divides: its chunk of the mean;
2. it quantizes that chunk mean again and an ``all_gather`` of those integers returns the
   whole mean, identical on every replica (everyone dequantizes the same bytes).

So a mean is a function of the multiset of the replicas' inputs (values plus residuals):
which replica sums which chunk (its axis position) changes only the order of the float32
sums. Where the integers would put no fewer bytes on the link they cross than the
float32 values (a tiny tree, a group of one), the mean is sent in float32 instead (see
:func:`plan`): one all-reduce, or with two levels the float32 two-level mean, whose
shards are all that crosses nodes. It is exact, and the residual becomes zero.

Error feedback keeps what rounding dropped and sends it next time: a replica's residual
holds its stage-1 rounding error on every chunk, and, on the chunk it summed, ``n`` times
the stage-2 rounding error of that chunk mean (which only it can know; it enters the next
mean with weight ``1 / n``). The sum of the means over many calls then equals the exact
sum up to one residual, whatever the rounding (see :func:`quantized_mean`).

A NaN or Inf makes the scale of its block NaN, so that whole block of the mean is NaN on
every replica (the non-finite values propagate, as with a plain all-reduce, a block
wide), wherever in the block it sits: each block is tested for finiteness, not left to
its maximum (a max reduction need not propagate NaN). The residual stays finite: it is 0
on a whole block that held a non-finite value (its finite values' rounding errors are
dropped too), and, on the replica that summed a chunk, on a block of the chunk mean that
came out non-finite.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lsgd_jax._core import _collectives
from lsgd_jax._core._collectives import Group, IndexGroups
from lsgd_jax.comm import _wire
from lsgd_jax.comm._codec import decode, encode


def position(group: Group) -> jax.Array:
    """This replica's index inside its group: the chunk an ``all_to_all`` hands it.

    Args:
      group: a resolved group (mesh axes, or an IndexGroups) where it is bound.

    Returns:
      An int32 scalar.

    Example:
      >>> import jax, jax.numpy as jnp, lsgd_jax
      >>> from lsgd_jax.comm import _quantize
      >>> g = lsgd_jax.IndexGroups("i", [[0, 2], [1, 3]])
      >>> jax.pmap(lambda x: _quantize.position(g), axis_name="i", devices=jax.devices()[:4])(
      ...     jnp.zeros(4)).tolist()
      [0, 0, 1, 1]
    """
    if isinstance(group, IndexGroups):
        table = np.zeros(sum(len(g) for g in group.groups), np.int32)
        for g in group.groups:
            for k, i in enumerate(g):
                table[i] = k
        return jnp.asarray(table)[lax.axis_index(group.axis_name)]
    return lax.axis_index(group)


class Layout(NamedTuple):
    """How a buffer is cut for a quantized mean (see :func:`plan`).

    Attributes:
      block: values per scale (at most the chunk).
      chunk: values per chunk, the share of one replica of the (outer) group: whole blocks.
      padded: the buffer's length once padded: ``inner x outer x chunk``.
    """

    block: int
    chunk: int
    padded: int


def plan(length: int, inner: int, outer: int, bits: int, block_size: int) -> Layout | None:
    """The cut of ``length`` values for a quantized mean, or None where the mean is sent
    in float32 instead: where the integers would put no fewer bytes on the link they
    cross than the float32 values would.

    One level: ``inner == 1`` and ``outer`` replicas; the float32 mean is one
    all-reduce over them. Two levels: a float32 reduce-scatter and all-gather over
    ``inner`` devices (inside the node either way), and across ``outer`` nodes the
    quantized mean of each device's shard; the float32 mean is the two-level one
    (``comm.two_level()``'s), whose shard of ``ceil(length / inner)`` values is all
    that crosses nodes. Each replica's chunk is its share of the values (of the shard),
    padded to whole blocks, and a block is never longer than the chunk: padding stays
    below one block per chunk, so bytes follow the data. The bytes over the ``outer``
    group are compared with the usual algorithms (what ``communication_report`` calls
    wire bytes): all-to-all + all-gather, ``2 (outer - 1) x chunk bytes``, against a
    ring all-reduce, ``2 (outer - 1) / outer x 4 x ceil(length / inner)``.

    Args:
      length: values in the buffer.
      inner: devices per node (1 for one level).
      outer: replicas (nodes) the quantized mean runs over.
      bits: 8 or 4.
      block_size: the largest block, values per scale.

    Returns:
      A :class:`Layout`, or None.

    Example:
      >>> from lsgd_jax.comm import _quantize
      >>> _quantize.plan(1 << 20, 1, 8, 8, 64)
      Layout(block=64, chunk=131072, padded=1048576)
      >>> _quantize.plan(14, 1, 8, 8, 64)  # 2 values per chunk: blocks of 2
      Layout(block=2, chunk=2, padded=16)
      >>> _quantize.plan(1, 1, 8, 8, 64) is None  # 5 bytes to send 4
      True
      >>> _quantize.plan(520, 4, 2, 8, 64)  # 2 x 136 bytes across nodes, not 520
      Layout(block=64, chunk=128, padded=1024)
    """
    if length == 0 or outer == 1:
        return None
    values = math.ceil(length / inner)  # this device's float32 values (its node's shard)
    share = math.ceil(values / outer)
    block = min(block_size, share + share % 2 if bits == 4 else share)
    chunk = math.ceil(share / block) * block
    chunk_bytes = chunk * bits // 8 + 4 * (chunk // block)
    # 2 (outer - 1) x chunk_bytes >= 2 (outer - 1) / outer x 4 x values, in integers:
    if outer * chunk_bytes >= 4 * values:
        return None
    return Layout(block, chunk, inner * outer * chunk)


def one_level(
    x: jax.Array, group: Group, bits: int, block_size: int
) -> tuple[jax.Array, jax.Array]:
    """The quantized mean of a flat buffer over ``group``, and this replica's residual.

    Every chunk is quantized, this replica's own chunk too, so the mean depends only on
    the replicas' values, not on which of them sums which chunk (up to the order of the
    float32 sums).

    Args:
      x: float32, length a multiple of ``group size * block_size``.
      group: a resolved group.
      bits: 8 or 4.
      block_size: values per scale.

    Returns:
      ``(mean, residual)``, both shaped like ``x``: the mean (identical on every replica
      of the group) and what this replica's rounding dropped (its stage-1 error on every
      chunk; plus ``n`` times the stage-2 error on the chunk it summed).

    Example:
      >>> import jax, jax.numpy as jnp, lsgd_jax
      >>> from jax.sharding import PartitionSpec as P
      >>> from lsgd_jax.comm import _quantize
      >>> mesh = lsgd_jax.make_mesh(1, 2)
      >>> f = jax.jit(jax.shard_map(lambda x: _quantize.one_level(x, ("local",), 8, 2)[0],
      ...     mesh=mesh, in_specs=P(("node", "local")), out_specs=P(("node", "local"))))
      >>> [round(v, 4) for v in f(jnp.array([1.0, 2, 3, 4, 3, 2, 1, 0])).tolist()]
      [2.0039, 2.0039, 2.0, 2.0, 2.0039, 2.0039, 2.0, 2.0]
    """
    axis, kwargs = _wire.axis_and_kwargs(group)
    n = _collectives.group_size(group)
    rows = x.reshape(n, -1)
    length = rows.shape[1]
    wire, sent = encode(rows, bits, block_size)
    received = decode(lax.all_to_all(wire, axis, 0, 0, **kwargs), bits, block_size, length)
    chunk_mean = received.sum(axis=0) / n
    wire2, sent2 = encode(chunk_mean[None], bits, block_size)
    gathered = _collectives.all_gather_tiled(wire2[0], axis, kwargs).reshape(n, -1)
    mean = decode(gathered, bits, block_size, length).reshape(-1)
    # Only the replica that summed a chunk knows its stage-2 error: it keeps n times it.
    own = (jnp.arange(n) == position(group))[:, None]
    residual = rows - sent + jnp.where(own, n * (chunk_mean - sent2[0])[None], 0.0)
    residual = jnp.where(jnp.isfinite(residual), residual, 0.0)
    return mean, residual.reshape(-1)


def two_level(
    x: jax.Array, inner: str, outer: tuple[Any, ...], bits: int, block_size: int
) -> tuple[jax.Array, jax.Array]:
    """The quantized mean over ``inner`` x ``outer``: only integers cross the outer axes.

    Float32 reduce-scatter over ``inner`` (each device gets its node's sum of one shard),
    :func:`one_level` over ``outer`` on that shard, float32 all-gather over ``inner``,
    divided by the group size. The residual is zero outside this device's shard.

    Args:
      x: float32, length a multiple of ``size(inner) * size(outer) * block_size``.
      inner: the node's mesh axis.
      outer: the other mesh axes of the group.
      bits: 8 or 4.
      block_size: values per scale.

    Returns:
      ``(mean, residual)``, both shaped like ``x``.

    Example:
      >>> import jax, jax.numpy as jnp, lsgd_jax
      >>> from jax.sharding import PartitionSpec as P
      >>> from lsgd_jax.comm import _quantize
      >>> mesh = lsgd_jax.make_mesh(2, 2)
      >>> f = jax.jit(jax.shard_map(
      ...     lambda x: _quantize.two_level(jnp.tile(x, 8), "local", ("node",), 8, 2)[0][:1],
      ...     mesh=mesh, in_specs=P(("node", "local")), out_specs=P(("node", "local"))))
      >>> f(jnp.array([0.0, 1.0, 2.0, 3.0])).tolist()
      [1.5, 1.5, 1.5, 1.5]
    """
    k = lax.axis_size(inner)
    shard = lax.psum_scatter(x, inner, scatter_dimension=0, tiled=True)
    shard_mean, shard_residual = one_level(shard, outer, bits, block_size)
    mean = _collectives.all_gather_tiled(shard_mean, inner, {}) / k
    start = lax.axis_index(inner) * shard.shape[0]
    residual = lax.dynamic_update_slice(jnp.zeros_like(x), shard_residual, (start,))
    return mean, residual


def quantized_mean(
    tree: Any,
    group: Group,
    state: Any,
    *,
    bits: int,
    block_size: int,
    two_level_inner: str | None,
    cast: bool = True,
) -> tuple[Any, Any]:
    """The mean of ``tree``'s floating leaves over ``group``, sent as integers.

    With ``state`` (a residual tree of ``tree``'s structure and shapes) the residual is
    added before quantizing and the new one returned: error feedback. Then, writing
    ``x_t`` for the values and ``r_t`` for the residuals summed over the group, each mean
    is ``mean_t = (x_t + r_t - r_{t+1}) / n``, so ``sum_t mean_t = sum_t x_t / n + (r_0 -
    r_T) / n``: what rounding dropped in one call is sent in a later one, and a run of
    averages drifts from the exact one by one residual at most.

    Args:
      tree: this replica's values.
      group: a resolved group.
      state: the residual (a tree like ``tree``), or None (no error feedback).
      bits: 8 or 4.
      block_size: values per scale.
      two_level_inner: the node's mesh axis for the two-level path, or None.
      cast: give each leaf back its own varying-axes type.

    Returns:
      ``(mean tree, new residual tree or None)``.

    Example:
      >>> import jax, jax.numpy as jnp, lsgd_jax
      >>> from jax.sharding import PartitionSpec as P
      >>> from lsgd_jax.comm import _quantize
      >>> mesh = lsgd_jax.make_mesh(1, 2)
      >>> f = jax.jit(jax.shard_map(lambda x: _quantize.quantized_mean(
      ...     {"w": x}, ("local",), None, bits=8, block_size=4, two_level_inner=None)[0]["w"],
      ...     mesh=mesh, in_specs=P(("node", "local")), out_specs=P(("node", "local"))))
      >>> f(jnp.array([1.0, 3.0]))
      Array([2., 2.], dtype=float32)
    """
    if two_level_inner is not None:
        _wire.check_inner_axis(group, two_level_inner, "quantized(two_level=True)")
        if _inside_node(group, two_level_inner):
            # Two-level means float32 inside the node: a mean that never leaves it (a
            # hierarchy's node level) is exact, and leaves the residual alone.
            return _collectives.mean(tree, group, cast), state
    packed = _wire.pack(tree)
    if not packed.picked:
        return tree, state
    residual_packed = _residual(packed, state)
    if not packed.size:  # only empty leaves: each one's mean is itself
        return packed.unpack(packed.flat, cast), state
    x = packed.flat if residual_packed is None else packed.flat + residual_packed.flat
    split = None
    if two_level_inner is not None:
        split = _wire.split_two_level(group, two_level_inner)
    mean, residual = _send(x, group, split, bits, block_size)
    value = packed.unpack(mean[: packed.size], cast)
    if residual_packed is None:
        return value, None
    return value, residual_packed.unpack(residual[: packed.size], cast=False)


def _residual(packed: _wire.Packed, state: Any) -> _wire.Packed | None:
    """The error-feedback state packed like the values (None without it)."""
    if state is None:
        return None
    residual = _wire.pack(state)
    if residual.size != packed.size:
        raise ValueError(
            f"quantized: the error-feedback state holds {residual.size} values "
            f"but the tree to average holds {packed.size}; create the state with "
            "strategy.init(tree) for a tree of the same structure and shapes."
        )
    return residual


def _send(
    x: jax.Array, group: Group, split: tuple[str, tuple[Any, ...]] | None, bits: int, block: int
) -> tuple[jax.Array, jax.Array]:
    """``(mean, residual)`` of the flat buffer ``x``, as :func:`plan` cuts it: quantized
    in one or two levels, or in float32 (exact: the residual is zero), one all-reduce or,
    with two levels across nodes, the two-level mean."""
    length = x.shape[0]
    if split is not None:
        inner, outer = split
        layout = plan(length, lax.axis_size(inner), lax.axis_size(outer), bits, block)
    else:
        layout = plan(length, 1, _collectives.group_size(group), bits, block)
    if layout is None:
        if split is None or lax.axis_size(outer) == 1:  # one level, or a single node
            return _collectives.mean(x, group, cast=False), jnp.zeros_like(x)
        size = _collectives.group_size(group)
        return _wire.two_level_sum(x, inner, outer) / size, jnp.zeros_like(x)
    x = jnp.pad(x, (0, layout.padded - length))
    if split is not None:
        return two_level(x, inner, outer, bits, layout.block)
    return one_level(x, group, bits, layout.block)


def _inside_node(group: Group, inner: str) -> bool:
    """Whether ``group`` is just the node's axis (its mean never crosses nodes)."""
    return isinstance(group, tuple) and tuple(group) == (inner,)


def zeros_state(tree: Any) -> Any:
    """A zero residual for ``tree``: float32 for real floating leaves, complex64 for complex
    ones, the leaf's own dtype (left out of the mean) for the others.

    Args:
      tree: values shaped like the ones to average (e.g. the params).

    Returns:
      A tree of zeros of ``tree``'s structure and shapes.

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax.comm import _quantize
      >>> z = _quantize.zeros_state({"w": jnp.ones(2, jnp.bfloat16), "n": jnp.int32(3)})
      >>> z["w"].dtype, z["n"].dtype
      (dtype('float32'), dtype('int32'))
    """

    def zero(x):
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.complexfloating):
            dtype = jnp.complex64
        elif jnp.issubdtype(x.dtype, jnp.floating):
            dtype = jnp.float32
        else:
            dtype = x.dtype
        return jnp.zeros(x.shape, dtype)

    return jax.tree.map(zero, tree)
