"""Replicas that span devices: each leaf sharded over the FSDP axes inside its replica.

One rule lays a leaf out (:func:`leaf_spec`): its largest dimension that divides by the
FSDP axes' size is split over them (the first such, on a tie); a leaf with none (a
scalar, a count, a bias of odd length) stays whole on every device of the replica.
``replicate(..., shard_over=)`` places params, optimizer state and averager state by it,
and ``data_parallel_step(..., fsdp_axes=)`` keeps the gradients in it, so the
optimizer's and the averager's state (anchors, outer momentum, error-feedback residuals,
delayed means) follow the params' shards, and averages move each shard across replicas
only. Inside the step each replica gathers its params for the loss, splits its rows of
the batch over the FSDP axes, and its gradients are reduced back onto the shards
(ZeRO-3 / FSDP; on CPU XLA emits an all-reduce and a slice, on GPU a reduce-scatter).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P


def check_axes(mesh: Mesh, data: tuple[str, ...], fsdp: Any, where: str) -> tuple[str, ...]:
    """``fsdp`` (None, a name or names) as a tuple of mesh axes that are not data axes.

    Example:
      >>> import lsgd_jax
      >>> from lsgd_jax._core._fsdp import check_axes
      >>> check_axes(lsgd_jax.make_mesh(2, 4), ("node",), "local", "replicate")
      ('local',)
    """
    if fsdp is None:
        return ()
    names = (fsdp,) if isinstance(fsdp, str) else tuple(fsdp)
    bad = [a for a in names if not isinstance(a, str) or a not in mesh.axis_names or a in data]
    if bad or not names:
        raise ValueError(
            f"{where}: FSDP axes {fsdp!r} must be mesh axes that are not data axes; the "
            f"mesh has axes {tuple(mesh.axis_names)} and the data axes are {data}. Pass the "
            "axis (or axes) over which each replica's params are sharded, e.g. "
            "shard_over='fsdp' on a mesh ('node', 'local', 'fsdp'), or None."
        )
    return names


def size(mesh: Mesh, axes: Sequence[str]) -> int:
    return int(np.prod([mesh.shape[a] for a in axes]))


def leaf_spec(shape: Sequence[int], mesh: Mesh, axes: tuple[str, ...]) -> P:
    """How a leaf of ``shape`` (no replica axis) is laid out inside its replica.

    Example:
      >>> import lsgd_jax
      >>> from lsgd_jax._core._fsdp import leaf_spec
      >>> mesh = lsgd_jax.make_mesh(2, 4)
      >>> leaf_spec((12, 16), mesh, ("local",)), leaf_spec((3,), mesh, ("local",))
      (P(None, 'local'), P(None,))
    """
    k = size(mesh, axes)
    spec: list[Any] = [None] * len(shape)
    fits = [i for i, d in enumerate(shape) if d % k == 0 and d >= k]
    if axes and fits:
        spec[max(fits, key=lambda i: (shape[i], -i))] = axes if len(axes) > 1 else axes[0]
    return P(*spec)


def gather(tree: Any) -> Any:
    """Every leaf whole on each device of its replica (inside the step's shard_map)."""
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, P()), tree)


def scatter(tree: Any, mesh: Mesh, axes: tuple[str, ...]) -> Any:
    """Every leaf back onto its shards (inside the step's shard_map)."""
    return jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x, leaf_spec(x.shape, mesh, axes)), tree
    )


def split_rows(batch: Any, axes: tuple[str, ...]) -> Any:
    """A replica's rows of the batch split over the FSDP axes (inside the shard_map)."""
    spec = P(axes if len(axes) > 1 else axes[0])
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, spec), batch)
