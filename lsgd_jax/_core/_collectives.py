"""The one place that means a pytree over mesh axes.

A *group* names the replicas a mean runs over. It is one of:

* ``None``: resolved by the caller to a default (every bound data axis, or ``"local"``);
* an axis name, or a tuple of axis names, of the enclosing ``jax.shard_map`` mesh or
  ``jax.pmap``;
* an :class:`IndexGroups`: a partition of one axis into groups of axis indices, the
  ``axis_index_groups`` of ``lax.pmean`` (the way to express a subgroup under a single
  ``pmap`` axis).

This module resolves a group where it runs (turning an unbound axis name into a clear
error), takes the mean of a pytree over it, and keeps the varying-axes types that
``shard_map`` checks stable, so that the mean can sit inside ``lax.cond`` and
``lax.switch`` branches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Union

import jax
import jax.numpy as jnp
from jax import lax

from lsgd_jax._core import _compat, _validate

AxisName = Hashable
Axes = tuple[AxisName, ...]


@dataclasses.dataclass(frozen=True)
class IndexGroups:
    """A subgroup of one mapped axis given by lists of axis indices.

    This is how a node-local group is named under ``jax.pmap``, which has a single axis:
    ``IndexGroups("batch", ((0, 1, 2, 3), (4, 5, 6, 7)))`` means over the first four and
    the last four indices of axis ``"batch"`` separately (``lax.pmean``'s
    ``axis_index_groups``). Under ``jax.shard_map`` it needs ``check_vma=False``; there,
    prefer naming a mesh axis.

    Attributes:
      axis_name: the mapped axis the indices refer to.
      groups: a partition of ``range(axis_size)`` into groups of equal size.

    Example:
      >>> import lsgd_jax
      >>> g = lsgd_jax.IndexGroups("batch", [[0, 1], [2, 3]])
      >>> g.groups
      ((0, 1), (2, 3))
    """

    axis_name: AxisName
    groups: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        try:
            groups = tuple(tuple(int(i) for i in g) for g in self.groups)
        except TypeError as e:
            raise TypeError(
                f"IndexGroups.groups must be a sequence of sequences of ints, got "
                f"{self.groups!r}; e.g. IndexGroups('batch', [[0, 1], [2, 3]])."
            ) from e
        object.__setattr__(self, "groups", groups)
        flat = [i for g in groups for i in g]
        if not groups or any(not g for g in groups):
            raise ValueError(f"IndexGroups.groups must hold non-empty groups, got {groups!r}.")
        if sorted(flat) != list(range(len(flat))):
            raise ValueError(
                f"IndexGroups.groups must partition range(n) (every index once), got {groups!r}."
            )
        if len({len(g) for g in groups}) != 1:
            raise ValueError(
                f"IndexGroups.groups must all have the same size (XLA requires it), got {groups!r}."
            )

    @property
    def group_size(self) -> int:
        """The number of replicas in each group."""
        return len(self.groups[0])


def node_groups(axis_name: AxisName, devices_per_node: int | None = None) -> IndexGroups:
    """The node-local groups of a single mapped axis (``jax.pmap``): one group per node.

    Under ``jax.pmap`` there is one axis, so the intra-node subgroup of post-local SGD
    is a partition of its indices. By default the partition follows the process layout:
    index ``i`` is ``jax.devices()[i]``, and a node is a process. On one process that is
    a single group (post-local SGD then averages within all devices every step); pass
    ``devices_per_node`` to cut the indices into consecutive blocks instead, e.g. to
    simulate two nodes of four devices on one host.

    Args:
      axis_name: the pmap axis name.
      devices_per_node: the size of each block of consecutive indices; default: group
        the indices by ``device.process_index``.

    Returns:
      An IndexGroups over ``axis_name``.

    Example:
      >>> import lsgd_jax
      >>> lsgd_jax.node_groups("batch", devices_per_node=4).groups
      ((0, 1, 2, 3), (4, 5, 6, 7))
    """
    devices = jax.devices()
    if devices_per_node is None:
        by_process: dict[int, list[int]] = {}
        for i, d in enumerate(devices):
            by_process.setdefault(d.process_index, []).append(i)
        return IndexGroups(axis_name, tuple(tuple(g) for g in by_process.values()))
    devices_per_node = _validate.positive_int(devices_per_node, "node_groups: devices_per_node")
    if len(devices) % devices_per_node:
        raise ValueError(
            f"node_groups: devices_per_node={devices_per_node} must be a positive divisor of "
            f"the {len(devices)} devices."
        )
    n = len(devices)
    return IndexGroups(
        axis_name,
        tuple(tuple(range(i, i + devices_per_node)) for i in range(0, n, devices_per_node)),
    )


GroupSpec = Union[None, AxisName, Sequence[AxisName], IndexGroups]
Group = Union[Axes, IndexGroups]


def normalize_group(spec: GroupSpec, what: str) -> Group | None:
    """Turns a user's group spec into ``None``, a tuple of axis names, or IndexGroups."""
    if spec is None or isinstance(spec, IndexGroups):
        return spec
    if isinstance(spec, (tuple, list)):
        axes = tuple(spec)
        if not axes:
            raise ValueError(
                f"{what} must name at least one mesh axis, got {spec!r}; pass None for "
                "the default or e.g. ('node', 'local')."
            )
        for a in axes:
            if not isinstance(a, Hashable) or isinstance(a, (tuple, list)):
                raise TypeError(f"{what}: axis names must be hashable scalars, got {a!r}.")
        if len(set(axes)) != len(axes):
            raise ValueError(f"{what} names an axis twice: {spec!r}.")
        return axes
    if isinstance(spec, Hashable):
        return (spec,)
    raise TypeError(
        f"{what} must be None, an axis name, a tuple of axis names or an IndexGroups, got {spec!r}."
    )


def group_axes(group: Group) -> frozenset[AxisName]:
    """The mesh axes a group spans (for IndexGroups, its one axis)."""
    if isinstance(group, IndexGroups):
        return frozenset([group.axis_name])
    return frozenset(group)


def group_covers(small: Group, big: Group) -> bool:
    """Whether every group of ``small`` lies inside one group of ``big`` (nesting)."""
    if isinstance(big, IndexGroups):
        if not isinstance(small, IndexGroups) or small.axis_name != big.axis_name:
            return False
        owner = {i: k for k, g in enumerate(big.groups) for i in g}
        owners = [{owner.get(i) for i in g} for g in small.groups]
        return all(len(o) == 1 and None not in o for o in owners)
    return group_axes(small) <= set(big)


def bound_axes() -> Axes:
    """The mapped axes (shard_map manual axes, or pmap axes) bound where this runs."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = tuple(getattr(mesh, "manual_axes", ()) or ())
    if manual:
        # Keep the mesh's order, which is the row-major replica order.
        return tuple(a for a in mesh.axis_names if a in manual)
    return _compat.mapped_axis_names()  # pmap and vmap axes: no public API yet


class AxisNotBoundError(NameError, ValueError):
    """A group names a mesh axis that is not bound where the function runs.

    Raised while tracing, with the missing axis, the bound ones, and the fix; and by the
    build check of a step (with the phase that needs the axis). A NameError, and a
    ValueError like the build check's other errors.

    Example:
      >>> import jax, jax.numpy as jnp, lsgd_jax
      >>> state = lsgd_jax.PostLocalSGDState(None, None, start_localSGD_iter=1)
      >>> try:
      ...     jax.jit(lsgd_jax.post_localSGD_hook)(state, jnp.ones(3))
      ... except lsgd_jax.AxisNotBoundError as e:
      ...     print(str(e)[:60])
      post_localSGD_hook: no mapped axis is bound here, so there i
    """


def _nothing_mapped(what: str) -> AxisNotBoundError:
    """The error for a mean called where no mapped axis is bound at all."""
    return AxisNotBoundError(
        f"{what}: no mapped axis is bound here, so there is no group of replicas to "
        "average over: it is a collective and runs inside a function mapped over the "
        "devices. Use lsgd_jax.data_parallel_step(loss_fn, tx, mesh), which does the "
        "mapping for you, or call it inside your own jax.shard_map(..., mesh=lsgd_jax."
        "make_mesh()) or jax.pmap(..., axis_name=...) step."
    )


def _check_bound(axes: Axes, what: str) -> None:
    for a in axes:
        try:
            lax.axis_size(a)
        except NameError:
            bound = bound_axes()
            if not bound:
                raise _nothing_mapped(what) from None
            hint = ""
            if len(bound) == 1:
                hint = (
                    f" Under jax.pmap there is one axis ({bound[0]!r}): name a node's group "
                    f"with lsgd_jax.node_groups({bound[0]!r}, devices_per_node=...)."
                )
            raise AxisNotBoundError(
                f"{what}: mesh axis {a!r} is not bound here (bound axes: {bound}). Name "
                f"the axes of the mesh this runs under (process_group= / subgroup=), or "
                f"run it in a jax.shard_map over a mesh with an axis {a!r} "
                f"(lsgd_jax.make_mesh() has ('node', 'local')).{hint}"
            ) from None


def resolve(group: Group | None, default: Callable[[], Group], what: str) -> Group:
    """Resolves a normalized group where it runs; checks that its axes are bound."""
    if group is None:
        group = default()
    if isinstance(group, IndexGroups):
        _check_bound((group.axis_name,), what)
        size = lax.axis_size(group.axis_name)
        n = sum(len(g) for g in group.groups)
        if n != size:
            raise ValueError(
                f"{what}: {group!r} covers {n} indices but axis {group.axis_name!r} has "
                f"size {size}; give groups that partition range({size})."
            )
    else:
        _check_bound(group, what)
    return group


def global_axes(what: str) -> Callable[[], Axes]:
    """The default global group: every bound mapped axis."""

    def default() -> Axes:
        axes = bound_axes()
        if not axes:
            raise _nothing_mapped(what)
        return axes

    return default


def group_size(group: Group) -> int:
    """The number of replicas one group holds (where the group is bound)."""
    if isinstance(group, IndexGroups):
        return group.group_size
    return lax.axis_size(group)


def vma(x: Any) -> frozenset[AxisName]:
    """The mesh axes over which ``x`` is typed as varying (empty outside shard_map)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))  # older JAX


def cast_varying(x: jax.Array, axes: frozenset[AxisName]) -> jax.Array:
    """Types ``x`` as varying over ``axes`` (a no-op for axes it already varies over)."""
    missing = tuple(a for a in sorted(axes, key=str) if a not in vma(x))
    if not missing:
        return x
    return lax.pcast(x, missing, to="varying")


def cast_tree_like(tree: Any, *likes: Any) -> Any:
    """Casts each leaf of ``tree`` to vary over the union of its peers' varying axes.

    Branches of ``lax.cond``/``lax.switch`` must return identical types; casting every
    branch's result to the same target makes them agree.
    """

    def cast(x, *peers):
        target = vma(x).union(*(vma(p) for p in peers))
        return cast_varying(x, target)

    return jax.tree.map(cast, tree, *likes)


def is_averaged(x: Any) -> bool:
    """Only floating (and complex) leaves are averaged; integer and bool leaves pass."""
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def accumulation_dtype(dtype: Any) -> Any:
    """The dtype a leaf is summed in: at least float32 (bf16/f16 means are taken in f32)."""
    return jnp.promote_types(dtype, jnp.float32)


def _psum(operands: list[jax.Array], group: Group) -> list[jax.Array]:
    if isinstance(group, IndexGroups):
        try:
            return lax.psum(operands, group.axis_name, axis_index_groups=group.groups)
        except NotImplementedError as e:
            raise NotImplementedError(
                f"A mean over {group!r} (axis_index_groups) is not supported here: under "
                "jax.shard_map it needs check_vma=False. Better, give the node its own mesh "
                "axis (lsgd_jax.make_mesh() has 'node' and 'local') and name it instead."
            ) from e
    return all_reduce(lax.psum, operands, group)


def all_reduce(reduce: Callable[..., Any], operands: Any, axes: Any) -> Any:
    """``reduce(operands, axes)`` (``lax.psum``, ``pmean``, ``pmax``...) over named mesh
    axes; over axes of one replica in all, the operands themselves (what the reduction
    gives), typed as it types them (invariant over ``axes``), without an all-reduce.

    XLA's SPMD partitioner rejects an all-reduce whose manual axes hold one device while
    other mesh axes stay automatic ("Cross-partition allreduce must be in (partial)
    manual partitioning mode"): a step with FSDP axes (or model axes) on a one-node
    mesh, e.g. an elastic run down to one process.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax import lax
      >>> from lsgd_jax._core._collectives import all_reduce
      >>> jax.vmap(lambda x: all_reduce(lax.psum, x, "i"), axis_name="i")(jnp.ones(1))
      Array([1.], dtype=float32)
    """
    gather = _compat.all_gather_invariant()
    if gather is not None and axes and lax.axis_size(axes) == 1 and _partly_manual():
        return jax.tree.map(lambda x: gather(x, axes)[0], operands)
    return reduce(operands, axes)


def _partly_manual() -> bool:
    """Whether this runs in a ``shard_map`` with some mesh axes manual, others automatic."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = getattr(mesh, "manual_axes", ())
    return bool(manual) and len(manual) < len(getattr(mesh, "axis_names", ()))


def _restore(
    out: list[Any], leaves: list[Any], picked: list[int], values: list[jax.Array], cast: bool
):
    for i, v in zip(picked, values):
        v = v.astype(jnp.result_type(leaves[i]))
        out[i] = cast_varying(v, vma(leaves[i])) if cast else v
    return out


def mean(tree: Any, group: Group, cast: bool = True) -> Any:
    """The mean of every inexact leaf of ``tree`` over ``group``; keeps leaf types.

    All averaged leaves go into one collective (a variadic all-reduce), as PyTorch
    flattens the parameters into one buffer. Leaves narrower than float32 (bfloat16,
    float16) are summed in float32 and rounded once at the end. Each leaf keeps its dtype
    and its varying-axes type, so the result can be returned from one branch of a
    ``lax.cond`` whose other branch returns ``tree`` unchanged. Integer and boolean
    leaves pass unchanged. ``cast=False`` keeps the collective's own, narrower
    varying-axes type (a global mean is then invariant).
    """
    leaves, treedef = jax.tree.flatten(tree)
    picked = [i for i, x in enumerate(leaves) if is_averaged(x)]
    if not picked:
        return tree
    size = group_size(group)
    sums = _psum([leaves[i].astype(accumulation_dtype(leaves[i].dtype)) for i in picked], group)
    out = _restore(list(leaves), leaves, picked, [s / size for s in sums], cast)
    return jax.tree.unflatten(treedef, out)


def finite_mean(tree: Any, group: Group, cast: bool = True) -> tuple[Any, jax.Array, jax.Array]:
    """The mean over the replicas of ``group`` whose leaves are all finite.

    A replica with any NaN or Inf in any averaged leaf of ``tree`` is left out of the
    sum and the count, and receives the mean of the others, so one diverged replica
    cannot poison the model. Still one collective: the finiteness flag rides along
    with the leaves. If no replica of a group is finite, its values are left as they are.

    Returns:
      ``(tree, excluded, finite)``: the averaged tree, the number (int32 scalar) of
      replicas of this replica's group that were left out, and whether this replica was
      finite.
    """
    leaves, treedef = jax.tree.flatten(tree)
    picked = [i for i, x in enumerate(leaves) if is_averaged(x)]
    if not picked:
        return tree, jnp.zeros([], jnp.int32), jnp.ones([], bool)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaves[i])) for i in picked]))
    zero = jnp.zeros([], jnp.float32)
    operands = [
        jnp.where(finite, leaves[i], 0).astype(accumulation_dtype(leaves[i].dtype)) for i in picked
    ]
    *sums, count = _psum([*operands, jnp.where(finite, 1.0, zero)], group)
    means = [
        jnp.where(count > 0, s / jnp.maximum(count, 1), leaves[i]) for s, i in zip(sums, picked)
    ]
    excluded = (group_size(group) - count).astype(jnp.int32)
    out = jax.tree.unflatten(treedef, _restore(list(leaves), leaves, picked, means, cast))
    return out, excluded, finite


def all_gather_tiled(x: jax.Array, axis: Any, kwargs: dict) -> jax.Array:
    """A tiled all_gather whose result is typed invariant over ``axis`` where JAX can.

    ``lax.all_gather`` types its result as varying, though every replica holds the same
    values; JAX's ``all_gather_invariant`` (not yet public) says so, which lets the
    result become a replicated (``P()``) value, e.g. an averager's anchor.
    """
    invariant = _compat.all_gather_invariant()
    if invariant is not None and not kwargs:
        return invariant(x, axis, tiled=True)
    return lax.all_gather(x, axis, tiled=True, **kwargs)


def cast_like(tree: Any, like: Any) -> Any:
    """``tree`` with the dtypes and varying-axes types of ``like`` (cond branches agree)."""
    return jax.tree.map(
        lambda x, y: cast_varying(jnp.asarray(x).astype(y.dtype), vma(y)),
        tree,
        like,
    )


def select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """``jnp.where(pred, a, b)`` leaf by leaf, for a scalar ``pred``.

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax._core._collectives import select
      >>> select(jnp.bool_(True), {"a": 1.0}, {"a": 2.0})
      {'a': Array(1., dtype=float32, weak_type=True)}
    """
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)
