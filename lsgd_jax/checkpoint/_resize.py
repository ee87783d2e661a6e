"""Restoring a checkpoint of N replicas onto M: which leaves are per replica, and the rule.

``restore_checkpoint(..., resize=True)`` reads a per-replica leaf (a leading axis of N
entries in the checkpoint, of M in the target, the rest of the shape alike) with its
saved shape, sharded over the target's mesh (the replica axis split over the target's
data axes when M divides N, else whole on every device), and gives every new replica
the same value:

- a floating leaf (params, momentum and Adam moments, the anchor, the outer optimizer's
  state, an error-feedback residual, a delayed average's start and mean, batch-norm
  statistics): the mean over the saved replicas, accumulated in float32 or wider;
  elementwise where every saved replica holds the same value, that value exactly (an
  anchor or a mean in flight, identical on every replica, comes back bitwise);
- an integer or bool leaf (the hook's ``iter``, the averager's ``step``,
  ``outer_count``, ``last_sync``, Adam's ``count``): the saved replicas must agree
  (:class:`ReplicasOutOfSyncError` otherwise), and the value is copied;
- ``ModelAveragerState.skipped``: whether any saved replica's group skipped.

The rule is linear where it averages, so it commutes with what the next steps do with
these values: a delayed average lands as ``params + (mean - start)``, and the mean of
the saved replicas' landings is the landing of the means; the next error-feedback mean
pays ``mean(residuals)``, which every new replica then holds. docs/checkpoints.md says why.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lsgd_jax._core import _state_protocol as sp
from lsgd_jax._core._replicas import ranges
from lsgd_jax.mesh import ReplicasOutOfSyncError

_SKIPPED = sp.FLAG  # whether any saved replica's group did (ModelAveragerState.skipped)


def read_abstract(manifest: dict, paths: list[str], abstract: list[Any], step: int) -> list[Any]:
    """What to read for each leaf: the target's abstract leaf, or, for a per-replica leaf
    saved with another replica count, one of the saved shape on the target's devices.

    Raises ValueError when a dtype differs, when a shape differs other than in its
    leading (replica) axis, or when the leaves disagree on the two replica counts.
    """
    counts: dict[tuple[int, int], list[str]] = {}
    read = []
    for p, shape, dtype, x in zip(paths, manifest["shapes"], manifest["dtypes"], abstract):
        saved, want = tuple(shape), tuple(np.shape(x))
        if dtype != str(np.dtype(x.dtype)) or (
            saved != want and (len(saved) != len(want) or not saved or saved[1:] != want[1:])
        ):
            raise ValueError(
                f"restore_checkpoint(resize=True): leaf {p or '(root)'} was saved as "
                f"{dtype}{list(saved)} but the target is {np.dtype(x.dtype)}{list(want)}: "
                "they differ beyond the leading replica axis. A resize changes only the "
                "number of replicas; build the target as the saved tree was built (same "
                "model, optimizer and dtypes), replicated over the new mesh."
            )
        if saved == want:
            read.append(x)
            continue
        counts.setdefault((saved[0], want[0]), []).append(p or "(root)")
        read.append(_saved_like(p, x, saved))
    if len(counts) > 1:
        pairs = "; ".join(f"{n} -> {m}: {names[:3]}" for (n, m), names in counts.items())
        raise ValueError(
            f"restore_checkpoint(resize=True): checkpoint {step}'s leaves change their "
            f"leading axis in more than one way ({pairs}). Per-replica leaves all have one "
            "entry per replica; build the target with one mesh (lsgd_jax.replicate(x, mesh))."
        )
    return read


def _saved_like(path: str, x: Any, saved: tuple[int, ...]) -> Any:
    """An abstract leaf of the saved shape: host leaves as numpy, device leaves on the
    target's mesh, the replica axis split as the target's is when that divides it."""
    if isinstance(x, np.ndarray):
        return np.zeros(saved, x.dtype)
    s = x.sharding
    if isinstance(s, NamedSharding):
        spec = tuple(s.spec) + (None,) * (len(saved) - len(s.spec))
        lead = spec[0]
        axes = () if lead is None else (lead if isinstance(lead, tuple) else (lead,))
        size = math.prod(s.mesh.shape[a] for a in axes)
        sharding: Any = NamedSharding(s.mesh, P(lead if saved[0] % size == 0 else None, *spec[1:]))
    elif s.is_fully_replicated:
        sharding = s
    else:
        raise ValueError(
            f"restore_checkpoint(resize=True): target leaf {path or '(root)'} has the "
            f"sharding {s}; a resized leaf needs a NamedSharding (as lsgd_jax.replicate "
            "makes) or a fully replicated one."
        )
    return jax.ShapeDtypeStruct(saved, x.dtype, sharding=sharding)


def roles(target: Any) -> list[str]:
    """For each leaf of ``target`` (in flatten order): ``sp.FLAG`` for a state's flag
    (whether any replica's group skipped), else ``"value"``."""
    return [_SKIPPED if r == sp.FLAG else "value" for r in sp.leaf_roles(target)]


def _reduce(x: Any, role: str, xp: Any) -> tuple[Any, Any]:
    """The one value every new replica gets, and whether an integer leaf agreed.

    ``xp`` is ``numpy`` (host leaves) or ``jax.numpy`` (inside the resizing program).

    Example:
      >>> import numpy as np
      >>> from lsgd_jax.checkpoint._resize import _reduce
      >>> _reduce(np.array([[1.0, 2.0], [4.0, 2.0]], np.float32), "value", np)
      (array([2.5, 2. ], dtype=float32), True)
      >>> _reduce(np.array([3, 4], np.int32), "value", np)  # a counter that disagrees
      (np.int32(3), np.False_)
    """
    if role == _SKIPPED:
        return xp.any(x, axis=0), True
    if not xp.issubdtype(x.dtype, xp.inexact):
        return x[0], xp.all(x == x[:1])
    acc = xp.promote_types(x.dtype, xp.float32)
    mean = xp.mean(x.astype(acc), axis=0).astype(x.dtype)
    return xp.where(xp.all(x == x[:1], axis=0), x[0], mean), True


def apply(
    step: int, paths: list[str], leaves: list[Any], abstract: list[Any], target: Any
) -> list[Any]:
    """The leaves of the target's replica count: per-replica leaves resized by the rule,
    the others as read. Raises ReplicasOutOfSyncError when an integer leaf disagrees."""
    kinds = roles(target)
    todo = [i for i, (x, a) in enumerate(zip(leaves, abstract)) if np.shape(x) != np.shape(a)]
    device = [i for i in todo if not isinstance(abstract[i], np.ndarray)]
    out = list(leaves)
    agreed: dict[int, Any] = {}
    for i in todo:
        if i not in device:
            value, agreed[i] = _reduce(np.asarray(leaves[i]), kinds[i], np)
            out[i] = np.array(np.broadcast_to(value, abstract[i].shape))
    if device:

        def body(*xs: Any) -> tuple[list[Any], list[Any]]:
            pairs = [_reduce(x, kinds[i], jnp) for i, x in zip(device, xs)]
            full = [jnp.broadcast_to(v, abstract[i].shape) for i, (v, _) in zip(device, pairs)]
            return full, [jnp.asarray(ok) for _, ok in pairs]

        shardings = [abstract[i].sharding for i in device]
        full, oks = jax.jit(body, out_shardings=(shardings, None))(*[leaves[i] for i in device])
        out = [full[device.index(i)] if i in device else x for i, x in enumerate(out)]
        agreed.update(zip(device, oks))
    bad = [i for i in todo if not bool(np.asarray(agreed[i]))]
    if bad:
        _disagree(step, [(paths[i], leaves[i]) for i in bad])
    return out


def _disagree(step: int, bad: list[tuple[str, Any]]) -> None:
    """Raises ReplicasOutOfSyncError naming each integer leaf's values by replica."""
    values: dict[str, dict[int, list[str]]] = {}
    lines = []
    for path, x in bad:
        flat = _host(x).reshape(np.shape(x)[0], -1)
        col = int(np.argmax((flat != flat[:1]).any(axis=0)))
        where = "" if flat.shape[1] == 1 else f" (element {col} of each replica's)"
        groups: dict[int, list[str]] = {}
        for v in dict.fromkeys(int(v) for v in flat[:, col]):
            reps = [r for r in range(flat.shape[0]) if int(flat[r, col]) == v]
            groups[v] = [f"replica{'s' if len(reps) > 1 else ''} {ranges(reps)}"]
        name = path or "(root)"
        values[name] = groups
        lines.append(f"{name}{where}: " + "; ".join(f"{v} on {g[0]}" for v, g in groups.items()))
    raise ReplicasOutOfSyncError(
        f"restore_checkpoint(resize=True): the replicas saved in checkpoint {step} "
        "disagree on integer values, which a resize copies (step counters must agree, "
        "and an integer has no mean):\n  " + "\n  ".join(lines) + "\nRestore a checkpoint "
        "saved by a run whose replicas were in sync; per-replica integers of your own (e.g. "
        "PRNG keys) restore without resize=True, or derive them anew for the new replicas.",
        values,
    )


def _host(x: Any) -> np.ndarray:
    """``x`` as numpy, also when its shards lie on several processes (a collective)."""
    if isinstance(x, np.ndarray) or getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
