"""How a mean's bytes travel: one flat buffer, and the collectives that move it.

Every strategy beyond the plain all-reduce (``lsgd_jax.comm``) works on one flat float32
buffer of a tree's averaged leaves (:func:`pack`), moves it with a few collectives, and
puts the result back (:class:`Packed`). This module holds those pieces: the packing, the
two-level sum (reduce-scatter inside the node, all-reduce of the shards across nodes,
all-gather inside the node: each value crosses the slow link about once, where a flat
ring all-reduce over every device sends 2 (n - 1) / n of the buffer per device over
whichever links the ring crosses), and the narrow-dtype mean (all-to-all + all-gather).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from lsgd_jax._core import _collectives
from lsgd_jax._core._collectives import Group, IndexGroups


@dataclasses.dataclass(frozen=True)
class Packed:
    """A tree's averaged leaves as one flat float32 buffer, and the way back.

    Complex leaves travel as their real and imaginary parts; integer and boolean leaves
    stay out of the buffer and come back unchanged.

    Attributes:
      flat: the float32 buffer.
      leaves: the tree's leaves.
      treedef: the tree's structure.
      picked: the indices of the averaged leaves.
    """

    flat: jax.Array
    leaves: list[Any]
    treedef: Any
    picked: tuple[int, ...]

    @property
    def size(self) -> int:
        return int(self.flat.shape[0])

    def unpack(self, flat: jax.Array, cast: bool = True) -> Any:
        """The tree with the averaged leaves read from ``flat`` (each in its own dtype;
        with ``cast``, in its own varying-axes type)."""
        out = list(self.leaves)
        parts = [(i, part) for i in self.picked for part in range(_parts(self.leaves[i]))]
        starts = iter(_offsets([self.leaves[i].size for i, _ in parts]))
        for i in self.picked:
            x = self.leaves[i]
            piece = lax.dynamic_slice(flat, (next(starts),), (x.size,)).reshape(x.shape)
            if jnp.iscomplexobj(x):
                imag = lax.dynamic_slice(flat, (next(starts),), (x.size,)).reshape(x.shape)
                piece = lax.complex(piece, imag)
            piece = piece.astype(x.dtype)
            out[i] = _collectives.cast_varying(piece, _collectives.vma(x)) if cast else piece
        return jax.tree.unflatten(self.treedef, out)


def _parts(x: Any) -> int:
    """Pieces a leaf takes in the buffer: 2 for a complex one (real, imaginary), else 1."""
    return 2 if jnp.iscomplexobj(x) else 1


def _offsets(sizes: list[int]) -> list[Any]:
    """Where each piece starts in the flat buffer: values computed at run time, where a
    mapped axis is bound, so that the compiler cannot fold them into the pieces' kernels.

    XLA compiles one kernel per distinct fusion, and reuses it for identical ones. A
    slice at a constant offset makes each leaf's kernel distinct: 128 leaves took 4 s
    to compile on CPU (one kernel each) against 0.5 s with the offsets as run-time
    values (one kernel per shape; measured with 32 x 32 leaves). So the offsets come
    out of one conditional on a predicate that is always true (a device's axis index
    is never negative) but unknown to the compiler. Outside a mapped axis: constants.
    """
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += size
    axes = _collectives.bound_axes()
    if len(starts) < 2 or not axes:
        return starts
    table = tuple(jnp.int32(s) for s in starts)
    zeros = tuple(jnp.zeros([], jnp.int32) for _ in starts)
    return list(lax.cond(lax.axis_index(axes[0]) >= 0, lambda: table, lambda: zeros))


def pack(tree: Any) -> Packed:
    """``tree``'s floating (and complex) leaves as one flat float32 buffer.

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax.comm import _wire
      >>> packed = _wire.pack({"a": jnp.ones(2), "n": jnp.int32(3), "z": jnp.array([1j])})
      >>> packed.flat.tolist(), packed.unpack(2 * packed.flat)["z"]
      ([1.0, 1.0, 0.0, 1.0], Array([0.+2.j], dtype=complex64))
    """
    leaves, treedef = jax.tree.flatten(tree)
    picked = tuple(i for i, x in enumerate(leaves) if _collectives.is_averaged(x))
    parts = []
    for i in picked:
        x = jnp.ravel(leaves[i])
        parts += [x.real, x.imag] if jnp.iscomplexobj(x) else [x]
    flat = (
        jnp.concatenate([p.astype(jnp.float32) for p in parts])
        if parts
        else jnp.zeros([0], jnp.float32)
    )
    return Packed(flat, leaves, treedef, picked)


def empty_mean(x: jax.Array, cast: bool = True) -> jax.Array:
    """The mean of an empty leaf: itself (a constant, with ``cast`` typed like ``x``).

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax.comm import _wire
      >>> _wire.empty_mean(jnp.zeros((3, 0), jnp.bfloat16)).shape
      (3, 0)
    """
    out = jnp.zeros(x.shape, x.dtype)
    return _collectives.cast_varying(out, _collectives.vma(x)) if cast else out


def axis_and_kwargs(group: Group) -> tuple[Any, dict]:
    """The ``axis_name`` and ``axis_index_groups`` keyword of a collective over ``group``."""
    if isinstance(group, IndexGroups):
        return group.axis_name, {"axis_index_groups": group.groups}
    return group, {}


def split_two_level(
    group: Group, inner: str, what: str = "two_level"
) -> tuple[str, tuple[Any, ...]] | None:
    """``(inner axis, outer axes)`` when a mean over ``group`` can go in two levels: the
    group holds ``inner`` (the node's devices) and at least one axis more.

    Else the mean takes one level (None): a group of ``inner`` alone (the node-local
    mean itself), a group without ``inner`` (e.g. ``("node",)``, one device of each node),
    or an IndexGroups under ``pmap``. But an ``inner`` that is not even a bound axis is a
    misspelling, and an error (see :func:`check_inner_axis`).

    Args:
      group: the mean's axes (or IndexGroups).
      inner: the node-local axis.
      what: the option's name, for the error.

    Returns:
      ``(inner, outer axes)``, or None for one level.
    """
    check_inner_axis(group, inner, what)
    if isinstance(group, IndexGroups) or inner not in group or len(group) < 2:
        return None
    return inner, tuple(a for a in group if a != inner)


def check_inner_axis(group: Group, inner: str, what: str) -> None:
    """Raises a ValueError when ``inner`` is not a mapped axis bound where the mean runs.

    An IndexGroups group (``pmap``) takes the one-level path whatever ``inner`` is.

    Example:
      >>> import jax, jax.numpy as jnp, lsgd_jax
      >>> from jax.sharding import PartitionSpec as P
      >>> from lsgd_jax.comm import _wire
      >>> f = jax.shard_map(lambda x: _wire.check_inner_axis(("node",), "lcoal", "demo") or x,
      ...     mesh=lsgd_jax.make_mesh(2, 2), in_specs=P(("node", "local")),
      ...     out_specs=P(("node", "local")))
      >>> try:
      ...     f(jnp.zeros(4))
      ... except ValueError as e:
      ...     print(str(e)[:58])
      demo: inner_axis 'lcoal' is not a mesh axis bound here (bo
    """
    if isinstance(group, IndexGroups) or inner in group:
        return
    bound = _collectives.bound_axes()
    if inner not in bound:
        raise ValueError(
            f"{what}: inner_axis {inner!r} is not a mesh axis bound here (bound axes: "
            f"{bound}), so no mean could go in two levels; name the mesh axis of one "
            f"node's devices as inner_axis (e.g. inner_axis='local' for "
            f"lsgd_jax.make_mesh()), or use a one-level strategy."
        )


def two_level_sum(flat: jax.Array, inner: str, outer: tuple[Any, ...]) -> jax.Array:
    """The sum of ``flat`` over ``inner`` x ``outer``, in three steps.

    Reduce-scatter over ``inner`` (each device of the node gets the node's sum of one
    shard), all-reduce of that shard over ``outer`` (the only step that crosses nodes,
    ``ceil(size / size(inner))`` values per device), all-gather over ``inner``. Every
    device gets the same sum, typed invariant over the group where JAX can say so.
    """
    k = lax.axis_size(inner)
    size = flat.shape[0]
    padded = jnp.pad(flat, (0, (-size) % k))
    shard = lax.psum_scatter(padded, inner, scatter_dimension=0, tiled=True)
    shard = lax.psum(shard, outer)
    return _collectives.all_gather_tiled(shard, inner, {})[:size]


def two_level_mean(tree: Any, group: Group, inner: str, cast: bool = True) -> Any:
    """The mean of ``tree``'s floating leaves over ``group``, in two levels where it can
    (see :func:`two_level_sum`), else one all-reduce.

    Leaf by leaf (XLA combines the collectives of one level into one): packing the tree
    into one buffer first costs a copy of every value, which on CPU is several times
    the collectives themselves (measured: 100 ms against 15 ms for 2.4M parameters on
    8 simulated devices).
    """
    split = split_two_level(group, inner)
    if split is None:
        return _collectives.mean(tree, group, cast)
    size = _collectives.group_size(group)

    def one(x):
        if not _collectives.is_averaged(x):
            return x
        if not x.size:  # an empty leaf's mean is itself (and a zero-size scatter is invalid)
            return empty_mean(x, cast)
        acc = jnp.ravel(x).astype(_collectives.accumulation_dtype(x.dtype))
        mean = (two_level_sum(acc, *split) / size).astype(x.dtype).reshape(x.shape)
        return _collectives.cast_varying(mean, _collectives.vma(x)) if cast else mean

    return jax.tree.map(one, tree)


def narrow_mean(tree: Any, group: Group, dtype: Any, cast: bool = True) -> Any:
    """The mean of ``tree``'s floating leaves over ``group``, sent in ``dtype``.

    The buffer, cast to ``dtype`` (e.g. bfloat16), is split into one chunk per replica;
    an ``all_to_all`` hands each replica its chunk from every peer, which it sums in
    float32 and divides; an ``all_gather`` of the chunk means, again in ``dtype``,
    returns the whole mean to everyone: about half the bytes of a float32 ring
    all-reduce, and every replica of the group gets the same result.
    """
    packed = pack(tree)
    if not packed.picked:
        return tree
    if not packed.size:  # only empty leaves: nothing to send
        return packed.unpack(packed.flat, cast)
    axis, kwargs = axis_and_kwargs(group)
    n = _collectives.group_size(group)
    buf = jnp.pad(packed.flat, (0, (-packed.size) % n)).astype(dtype).reshape(n, -1)
    received = lax.all_to_all(buf, axis, 0, 0, **kwargs)
    chunk_mean = received.astype(jnp.float32).sum(axis=0) / n
    full = _collectives.all_gather_tiled(chunk_mean.astype(dtype), axis, kwargs)
    return packed.unpack(full.astype(jnp.float32)[: packed.size], cast)
