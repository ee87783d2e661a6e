"""Meshes for post-local SGD: one row of devices per node."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jax.tree_util import tree_flatten_with_path

from lsgd_jax._core import _leaves, _validate
from lsgd_jax._core._replicas import LOCAL_AXIS, NODE_AXIS, num_replicas, replica_spec
from lsgd_jax.mesh import _threads


def make_mesh(
    num_nodes: int | None = None,
    devices_per_node: int | None = None,
    *,
    devices: Sequence[Any] | None = None,
    axis_types: Any = None,
) -> Mesh:
    """A data-parallel mesh with axes ``("node", "local")``, one node per row.

    ``"local"`` spans the devices of one node, contiguous; ``"node"`` spans the nodes.
    The global group of post-local SGD is both axes, the subgroup ``"local"``. Replica
    ``r`` (PyTorch's rank ``r``) is the device at row-major position ``r``.

    Devices are ordered by ``(process_index, id)``, so on a multi-process run each
    process's devices form its own row by default (one process = one node, the usual
    layout: one process per host). A node may also be several whole processes, e.g. one
    process per GPU: pass ``num_nodes=<number of hosts>``; the processes of one host
    must then have consecutive process indices (SLURM's default block distribution).

    Args:
      num_nodes: rows of the mesh; default ``jax.process_count()``, or, when only
        ``devices_per_node`` is given, ``len(devices) // devices_per_node``.
      devices_per_node: columns; default ``len(devices) // num_nodes``
        (``jax.local_device_count()`` when both are defaulted).
      devices: the devices to use (default ``jax.devices()``); the first
        ``num_nodes * devices_per_node`` in ``(process_index, id)`` order are taken.
      axis_types: passed to ``jax.sharding.Mesh``. Default: ``Auto`` axes (what
        ``jax.sharding.Mesh`` makes; ``jax.make_mesh`` now defaults to ``Explicit``), so
        that the same mesh also serves plain ``jax.jit`` code whose shardings the
        compiler propagates (e.g. a DDP baseline written without shard_map), which
        Explicit axes reject with a ``ShardingTypeError``. ``shard_map`` and
        :func:`data_parallel_step` work with either; pass
        ``(jax.sharding.AxisType.Explicit,) * 2`` for explicit-sharding code.

    On simulated CPU devices it warns (once a process) when XLA's CPU thread pool is
    too small for the mesh, which can abort the process in a collective, and names the
    remedy (:func:`check_cpu_threads`).

    Returns:
      A ``jax.sharding.Mesh`` of shape ``(num_nodes, devices_per_node)``.

    Example:
      >>> import lsgd_jax
      >>> mesh = lsgd_jax.make_mesh(num_nodes=2, devices_per_node=4)
      >>> dict(mesh.shape)
      {'node': 2, 'local': 4}
    """
    devs = sorted(
        devices if devices is not None else jax.devices(), key=lambda d: (d.process_index, d.id)
    )
    for name, v in (("num_nodes", num_nodes), ("devices_per_node", devices_per_node)):
        if v is not None:
            _validate.positive_int(v, f"make_mesh: {name}")
    if devices_per_node is not None:
        per_node = devices_per_node
        nodes = num_nodes if num_nodes is not None else len(devs) // per_node
    else:
        default = jax.process_count() if devices is None else 1
        nodes = num_nodes if num_nodes is not None else default
        per_node = len(devs) // nodes
    n = nodes * per_node
    if n == 0 or n > len(devs):
        raise ValueError(
            f"make_mesh: num_nodes={nodes} x devices_per_node={per_node} needs "
            f"{n} devices, but {len(devs)} are available; ask for fewer, or start JAX with "
            "more (e.g. jax.config.update('jax_num_cpu_devices', 8) before first use)."
        )
    grid = np.array(devs[:n], dtype=object).reshape(nodes, per_node)
    _check_node_rows(grid)
    kwargs = {} if axis_types is None else {"axis_types": axis_types}
    mesh = Mesh(grid, (NODE_AXIS, LOCAL_AXIS), **kwargs)
    _threads.check_cpu_threads(mesh)
    return mesh


def _check_node_rows(grid: np.ndarray) -> None:
    """Each row (node) lies inside one process, or is made of whole processes."""
    per_process = collections.Counter(d.process_index for d in grid.flat)
    for row in grid:
        here = collections.Counter(d.process_index for d in row)
        split = sorted(p for p, n in here.items() if n != per_process[p])
        if len(here) > 1 and split:
            raise ValueError(
                f"make_mesh: node row {list(row)} spans processes {sorted(here)} but holds "
                f"only some of the devices of process(es) {split}. A node must lie inside "
                "one process (devices_per_node divides each process's device count) or "
                "consist of whole processes (one process per GPU: num_nodes = number of "
                "hosts)."
            )


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """The data-parallel axes of ``mesh``: every axis up to ``"local"``, else all.

    By our convention the replica axes come first and end with the intra-node axis
    ``"local"``: ``("node", "local")``, or ``("pod", "node", "local")`` for a 3-level
    hierarchy; axes after it (e.g. ``"model"``) are model-parallel. A mesh without a
    ``"local"`` axis is taken to be all data-parallel; pass ``axes=`` where it is not.

    Args:
      mesh: a ``jax.sharding.Mesh``.

    Returns:
      The tuple of axis names that index replicas.

    Example:
      >>> import lsgd_jax
      >>> lsgd_jax.data_axes(lsgd_jax.make_mesh(2, 4))
      ('node', 'local')
    """
    names = tuple(mesh.axis_names)
    if LOCAL_AXIS in names:
        return names[: names.index(LOCAL_AXIS) + 1]
    return names


def replicate(
    tree: Any,
    mesh: Mesh,
    axes: Sequence[str] | None = None,
    *,
    shard_over: str | Sequence[str] | None = None,
) -> Any:
    """One copy of ``tree`` per data-parallel replica, sharded over the data axes.

    Each leaf gets a leading replica axis of size ``prod(mesh.shape[a] for a in axes)``,
    sharded over ``axes``, so that every device holds its own copy: what local SGD needs,
    since replicas diverge between averages. Inside ``jax.shard_map`` with
    ``in_specs=P(axes)`` each device sees a leading axis of size 1 (take ``x[0]``).

    With ``shard_over`` a replica spans the devices of those (non-data) mesh axes and
    each leaf is split over them, on its largest dimension that divides by their size
    (docs/training_loops.md, FSDP); build the step with ``fsdp_axes=shard_over``.

    Every leaf must be an array: a function or a Python bool is refused, naming the leaf
    and the fix (``eqx.partition(model, eqx.is_inexact_array)``); ``None`` leaves pass; a
    Python number is replicated with a warning naming it (docs/equinox.md). It warns
    (once a process) when simulated CPU devices have too few threads for ``mesh``.

    Args:
      tree: a pytree of arrays (the same on every process).
      mesh: the mesh, e.g. from :func:`make_mesh`.
      axes: the data axes; default :func:`data_axes` of ``mesh``.
      shard_over: FSDP axes inside each replica (None: each device holds whole leaves).

    Returns:
      The pytree with replicated, sharded leaves.

    Raises:
      TypeError: ``mesh`` is not a ``jax.sharding.Mesh``; or a leaf is neither an array
        nor a number, or is a Python bool (the message names the leaf).

    Example:
      >>> import jax.numpy as jnp, lsgd_jax
      >>> mesh = lsgd_jax.make_mesh(2, 4)
      >>> lsgd_jax.replicate({"w": jnp.ones(3)}, mesh)["w"].shape
      (8, 3)
      >>> w = lsgd_jax.replicate(jnp.ones((3, 8)), mesh, axes=("node",), shard_over="local")
      >>> w.shape, w.sharding.spec, w.addressable_shards[0].data.shape
      ((2, 3, 8), P('node', None, 'local'), (1, 3, 2))
    """
    from jax.sharding import NamedSharding

    from lsgd_jax import averaging
    from lsgd_jax._core import _fsdp

    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"replicate: mesh must be a jax.sharding.Mesh, got {mesh!r} "
            f"({type(mesh).__name__}); pass the mesh to lay the replicas on, e.g. "
            "replicate(params, lsgd_jax.make_mesh())."
        )
    axes = tuple(axes) if axes is not None else data_axes(mesh)
    inside = _fsdp.check_axes(mesh, axes, shard_over, "replicate: shard_over")
    n = num_replicas(mesh, axes)
    _leaves.refuse_non_arrays(tree, "replicate")
    _leaves.name_python_numbers(tree, "replicate", n)
    _threads.check_cpu_threads(mesh)  # a mesh not from make_mesh: warned here, once

    def one(x, memory_kind=None):
        host = np.asarray(x)
        spec = replica_spec(host.shape, mesh, axes, inside)
        full = np.broadcast_to(host[None], (n, *host.shape))
        sharding = NamedSharding(mesh, spec, memory_kind=memory_kind)
        return jax.make_array_from_callback(full.shape, sharding, lambda index: full[index])

    def node(x):  # an offloaded averager's buffers go to host memory
        return averaging.place(x, one) if averaging.is_offloaded(x) else one(x)

    return jax.tree.map(node, tree, is_leaf=averaging.is_offloaded)


def _leading_split(x: Any) -> tuple[tuple[str, ...], Any] | None:
    """The mesh axes that split ``x``'s leading axis, and their mesh, for an array laid
    out on a mesh of several devices (a NamedSharding); None for an array that carries
    no such layout (a NumPy array, a single device's, a one-device mesh's)."""
    from jax.sharding import NamedSharding

    sharding = getattr(x, "sharding", None)
    if not isinstance(x, jax.Array) or not isinstance(sharding, NamedSharding):
        return None
    if sharding.mesh.size == 1:
        return None
    spec = tuple(sharding.spec)
    lead = spec[0] if spec else None
    return (() if lead is None else lead if isinstance(lead, tuple) else (lead,)), sharding.mesh


def _per_replica(tree: Any, who: str) -> None:
    """Checks that every leaf of ``tree`` carries a leading replica axis (the rule of
    :func:`consensus`); the error names the leaf, its shape, the replicas expected and
    the fix."""
    fix = (
        "Replicate it with lsgd_jax.replicate(x, mesh) (one copy per replica), or leave "
        f"it out of the tree: pass only the replicated part, e.g. {who}(state['params'])."
    )
    leaves = [(jax.tree_util.keystr(k) or "(root)", x) for k, x in tree_flatten_with_path(tree)[0]]
    for name, x in leaves:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(
                f"{who}: leaf {name} is {x!r} ({type(x).__name__}), not an array with a "
                "leading replica axis: a Python value is one value for all replicas, with "
                f"no replica's copy to take and nothing to average. {fix}"
            )
    counts = _replica_counts_on_meshes(leaves, who, fix)
    if counts:
        n, first = next(iter(counts.items()))
        why = f"as leaf {first} is laid out on its mesh"
    else:  # no mesh in sight: the replica count most leaves agree on
        firsts = collections.Counter(np.shape(x)[0] for _, x in leaves if np.ndim(x))
        n, why = (firsts.most_common(1)[0][0] if firsts else 0), "as most leaves have"
    misread = {"consensus": "its own elements would be averaged"}.get(
        who, "its first element would be taken for a replica's copy"
    )
    for name, x in leaves:
        shape = tuple(np.shape(x))
        if not shape or shape[0] != n:
            raise ValueError(
                f"{who}: leaf {name} has shape {shape}, but per-replica values have a "
                f"leading axis of {n} replicas ({why}); "
                f"{misread if shape else 'a scalar has none'}. {fix}"
            )
        if counts and n > 1 and isinstance(x, jax.Array) and len(x.sharding.device_set) == 1:
            raise ValueError(
                f"{who}: leaf {name} of shape {shape} lives on one device, not on the "
                f"mesh of the replicas ({why}): it was never replicated, so its leading "
                f"axis is not the {n} replicas' even if it has that length. {fix}"
            )


def _replica_counts_on_meshes(leaves: list[tuple[str, Any]], who: str, fix: str) -> dict:
    """``{replicas: first leaf}`` of the leaves laid out on a mesh, each checked to be
    split over the data axes, one entry a replica; at most one count in a tree."""
    counts: dict[int, str] = {}
    for name, x in leaves:
        layout = _leading_split(x)
        if layout is None or not x.shape:
            continue
        axes, mesh = layout
        data = data_axes(mesh)
        if not axes and x.shape[0] > 1:  # (a single replica's axis is not split: P(None))
            raise ValueError(
                f"{who}: leaf {name} of shape {x.shape} is one copy on every device of its "
                f"mesh (sharding {x.sharding.spec}), not one per replica: per-replica "
                f"values have one entry a replica on their leading axis, split over the "
                f"data axes {data} ({num_replicas(mesh, data)} replicas, one a device, as "
                f"lsgd_jax.replicate(x, mesh) makes). {fix} If its rows are the replicas' "
                f"values, lay them out so: jax.device_put(x, NamedSharding(mesh, P({data})))."
            )
        count = num_replicas(mesh, axes)
        if not set(axes) <= set(data):
            raise ValueError(
                f"{who}: leaf {name} of shape {x.shape} has its leading axis split over "
                f"{axes}, not over the data axes {data} (sharding {x.sharding.spec}): it is "
                f"not per-replica. {fix}"
            )
        if axes and x.shape[0] != count:
            raise ValueError(
                f"{who}: leaf {name} has shape {x.shape}, its leading axis split over "
                f"{axes}: {x.shape[0] / count:g} entries per replica, but per-replica values "
                f"have one, a leading axis of {count} replicas (as lsgd_jax.replicate "
                f"makes). {fix}"
            )
        counts.setdefault(count, name)
    if len(counts) > 1:
        (n1, a), (n2, b) = list(counts.items())[:2]
        raise ValueError(
            f"{who}: leaves {a} and {b} hold {n1} and {n2} replicas on their leading axes: "
            "one tree holds the values of one set of replicas. Pass values replicated over "
            "different meshes or axes in separate calls."
        )
    return counts


def unreplicate(tree: Any) -> Any:
    """Replica 0's copy of a replicated pytree (drops the leading replica axis).

    With several processes, replica 0 lives on process 0: this is then a collective
    (every process must call it) that returns arrays replicated on every device, which
    any process can read (``np.asarray``).

    Every leaf must be per-replica, as :func:`consensus` checks (the same rule).

    Args:
      tree: a pytree as made by :func:`replicate` (leading replica axis).

    Returns:
      The pytree of replica 0.

    Raises:
      TypeError: a leaf is a Python value (e.g. a step count ``5``), not an array.
      ValueError: a leaf has no leading replica axis (see :func:`consensus`).

    Example:
      >>> import jax.numpy as jnp, lsgd_jax
      >>> mesh = lsgd_jax.make_mesh(2, 4)
      >>> lsgd_jax.unreplicate(lsgd_jax.replicate(jnp.arange(3.0), mesh))
      Array([0., 1., 2.], dtype=float32)
      >>> lsgd_jax.unreplicate({"w": lsgd_jax.replicate(jnp.arange(3.0), mesh), "step": 5})
      Traceback (most recent call last):
      ...
      TypeError: unreplicate: leaf ['step'] is 5 (int), not an array with a leading ...
    """
    _per_replica(tree, "unreplicate")
    return _one_program_per_devices(tree, _first_replicas, lambda x: x[0])


def consensus(tree: Any) -> Any:
    """The mean over replicas of a replicated pytree: the model to evaluate or export.

    Floating leaves are averaged over the leading replica axis (accumulated in at least
    float32); other leaves are taken from replica 0. With several processes this is a
    collective (every process must call it); the result is replicated on every device,
    so any process can read it.

    Every leaf must be per-replica: a leading axis of one entry per replica. A leaf laid
    out on a mesh (as :func:`replicate` and :func:`data_parallel_step` make them) must
    have that axis split over the mesh's data axes (:func:`data_axes`, or some of them,
    e.g. ``("node",)`` when a replica spans a node's devices), one entry a replica, and
    the leaves must agree on the number of replicas; beside such leaves, a ``jax.Array``
    on a single device was never replicated and is refused whatever its length. Where no
    leaf is laid out on a mesh (NumPy arrays, arrays on one device, e.g. after
    ``jax.device_get``), the replica count is the leading axis that most leaves have,
    and every leaf must have it (a tree of one such array is taken as it is). So a step
    count ``5``, a 0-d array, a leaf never replicated (whose own elements would
    otherwise be averaged), or one copy on every device (sharding ``P()``) raises an
    error that names the leaf instead of being silently misread.

    Args:
      tree: a pytree with a leading replica axis on every leaf, e.g. the params that
        :func:`data_parallel_step` returns.

    Returns:
      The pytree without the replica axis.

    Raises:
      TypeError: a leaf is a Python value (e.g. ``{"params": p, "step": 5}``), not an
        array; leave it out, or replicate it.
      ValueError: a leaf has no leading replica axis, or one of another number of
        replicas than the other leaves', or one not split over the data axes; the
        message names the leaf (its key path), its shape and the replicas expected.

    Example:
      >>> import jax.numpy as jnp, lsgd_jax
      >>> lsgd_jax.consensus({"w": jnp.array([[1.0, 2.0], [3.0, 4.0]])})
      {'w': Array([2., 3.], dtype=float32)}
      >>> mesh = lsgd_jax.make_mesh(2, 4)
      >>> p = lsgd_jax.replicate({"w": jnp.ones(2)}, mesh)
      >>> lsgd_jax.consensus({"params": p, "b": jnp.ones(3)})
      Traceback (most recent call last):
      ...
      ValueError: consensus: leaf ['b'] has shape (3,), but per-replica values have a ...
    """
    _per_replica(tree, "consensus")
    return _one_program_per_devices(tree, _replica_means, _replica_mean)


def _replica_mean(x: Any) -> Any:
    import jax.numpy as jnp

    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return x[0]
    acc = jnp.promote_types(x.dtype, jnp.float32)
    return jnp.mean(x.astype(acc), axis=0).astype(x.dtype)


@jax.jit
def _replica_means(leaves: list[Any]) -> list[Any]:
    return [_replica_mean(x) for x in leaves]


@jax.jit
def _first_replicas(leaves: list[Any]) -> list[Any]:
    return [x[0] for x in leaves]


def _one_program_per_devices(tree: Any, program: Any, one: Any) -> Any:
    """``one`` applied to every leaf of ``tree``: the JAX arrays of each set of devices
    in one call of the jitted ``program`` (one launch for the whole tree, not one or
    more a leaf), the other leaves (NumPy) one by one.

    On simulated CPU devices a burst of small programs with collectives, one a leaf,
    could fill XLA's per-device queues and abort the process in its rendezvous
    (see :func:`check_cpu_threads`); one program for the tree is also faster.
    """
    leaves, treedef = jax.tree.flatten(tree)
    out = list(leaves)
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
            out[i] = one(x)  # traced (already inside a program) or on the host
        else:
            groups.setdefault(frozenset(x.sharding.device_set), []).append(i)
    for idx in groups.values():
        for i, y in zip(idx, program([leaves[i] for i in idx])):
            out[i] = y
    return jax.tree.unflatten(treedef, out)
