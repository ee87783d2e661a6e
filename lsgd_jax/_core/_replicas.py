"""Replicas on a mesh: the axis names, how many replicas a set of axes holds, and how
a replicated leaf is laid out. Shared by ``mesh``, ``step``, ``checkpoint`` and
``elastic``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jax.sharding import Mesh, PartitionSpec

from lsgd_jax._core import _fsdp

NODE_AXIS = "node"
LOCAL_AXIS = "local"


def num_replicas(mesh: Mesh, axes: tuple[str, ...]) -> int:
    """How many replicas ``axes`` of ``mesh`` hold (the product of their sizes)."""
    return int(np.prod([mesh.shape[a] for a in axes]))


def replica_spec(shape: Sequence[int], mesh: Mesh, axes: tuple[str, ...], inside: tuple[str, ...]):
    """How ``lsgd_jax.replicate`` lays out a leaf of ``shape`` (without its replica axis): the
    replica axis over ``axes``, and inside each replica the FSDP rule over ``inside``.

    Example:
      >>> import lsgd_jax
      >>> from lsgd_jax._core._replicas import replica_spec
      >>> mesh = lsgd_jax.make_mesh(2, 4)
      >>> replica_spec((3, 8), mesh, ("node",), ("local",)), replica_spec((3,), mesh, ("node",), ())
      (P('node', None, 'local'), P('node',))
    """
    inner = list(_fsdp.leaf_spec(shape, mesh, inside))
    while inner and inner[-1] is None:  # P(axes) when nothing is split inside
        inner.pop()
    return PartitionSpec(axes, *inner)


def ranges(ints: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``: replicas or devices named in a message."""
    ints = sorted(set(ints))
    parts, i = [], 0
    while i < len(ints):
        j = i
        while j + 1 < len(ints) and ints[j + 1] == ints[j] + 1:
            j += 1
        parts.append(str(ints[i]) if i == j else f"{ints[i]}-{ints[j]}")
        i = j + 1
    return ",".join(parts)
