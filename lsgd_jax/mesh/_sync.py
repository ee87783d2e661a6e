"""assert_replicas_in_sync: every replica and process holds the same step counters.

Post-local SGD branches on its step counters (``PostLocalSGDState.iter`` picks the global
or the node-local gradient mean, ``ModelAveragerState.step`` picks the averaging steps).
The branch must be the same on every replica: a replica that takes the other branch
waits in a different collective, and the run hangs instead of failing. This module
gathers the counters, which are a few integers, and raises a clear error when they
differ, before the next collective would deadlock.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from lsgd_jax._core import _state_protocol as sp
from lsgd_jax._core._replicas import ranges

# One record per counter value held here: (counter index, replica, device id, value).
_FIELDS = 4


class ReplicasOutOfSyncError(RuntimeError):
    """Replicas or processes hold different step counters (see assert_replicas_in_sync).

    Attributes:
      values: for each disagreeing counter (by its path in the tree), the distinct values
        and where they were found, as ``{path: {value: [location, ...]}}``.

    Example:
      >>> import lsgd_jax
      >>> err = lsgd_jax.ReplicasOutOfSyncError("out of sync", {"[0].iter": {3: ["r0"]}})
      >>> err.values
      {'[0].iter': {3: ['r0']}}
    """

    def __init__(self, message: str, values: dict[str, dict[int, list[str]]]) -> None:
        super().__init__(message)
        self.values = values


_is_counter_node = sp.is_state


def step_counters(tree: Any) -> dict[str, Any]:
    """The step counters of post-local SGD found in ``tree``, by path.

    Finds every ``PostLocalSGDState.iter`` and ``ModelAveragerState.step`` at any depth
    (e.g. inside an ``optax.chain`` state, a replicated optimizer state, or a dict that
    holds both params and optimizer state).

    The two count differently. ``iter`` is PyTorch's ``PostLocalSGDState.iter``: it
    counts the hook's calls until ``start_localSGD_iter`` and then stops there (the
    hook only needs to know that it has switched), so after the switch it no longer
    says how many steps ran. The averager's ``step`` counts every call. Read ``step``
    (or count the steps yourself) for the number of steps taken.

    Args:
      tree: any pytree, or a ``flax.nnx.Optimizer`` (its ``opt_state`` is read).

    Returns:
      A dict from the counter's path (``jax.tree_util.keystr`` of its node, plus
      ``.iter`` or ``.step``) to the counter array, in tree order.

    Example:
      >>> import optax, lsgd_jax
      >>> tx = optax.chain(lsgd_jax.post_local_sgd(4), optax.sgd(0.1),
      ...     lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, warmup_steps=4)))
      >>> list(lsgd_jax.step_counters(tx.init({})))
      ['[0].iter', '[2].step']

      Six updates later ``iter`` has stopped at the switch (4) and ``step`` is 6:

      >>> import jax, jax.numpy as jnp
      >>> mesh = lsgd_jax.make_mesh(2, 4)
      >>> stx = lsgd_jax.stacked(tx, mesh)  # the chain on stacked per-replica trees
      >>> params = lsgd_jax.replicate(jnp.zeros(3), mesh)
      >>> state, update = stx.init(params), jax.jit(stx.update)
      >>> for _ in range(6):
      ...     _, state = update(jnp.ones((8, 3)), state, params)
      >>> {path: int(c[0]) for path, c in lsgd_jax.step_counters(state).items()}
      {'[0].iter': 4, '[2].step': 6}
    """
    found = {}
    tree = sp.read_through(tree)  # an nnx.Optimizer: its optax state
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_counter_node)
    for path, node in flat:
        if sp.is_state(node):
            found[f"{jax.tree_util.keystr(path)}.{node.COUNTER_FIELD}"] = node.counter
    return found


def _local_records(index: int, x: Any) -> list[tuple[int, int, int, int]]:
    """(index, replica, device, value) for each copy of counter ``x`` held here.

    A counter with a leading axis is per replica (its position on that axis); a scalar
    counter has replica -1. Host values (numpy, Python ints) have device -1.
    """
    records = []
    if isinstance(x, jax.Array):
        for shard in sorted(x.addressable_shards, key=lambda s: s.device.id):
            data = np.asarray(shard.data)
            if data.ndim == 0:
                records.append((index, -1, shard.device.id, int(data)))
                continue
            lead = shard.index[0] if shard.index else slice(None)
            start = lead.start or 0
            for k, v in enumerate(data.reshape(data.shape[0], -1)[:, 0]):
                records.append((index, start + k, shard.device.id, int(v)))
        return records
    data = np.asarray(x)
    if data.ndim == 0:
        return [(index, -1, -1, int(data))]
    return [(index, r, -1, int(v)) for r, v in enumerate(data.reshape(data.shape[0], -1)[:, 0])]


def _allgather(x: np.ndarray) -> np.ndarray:
    """Stacks ``x`` from every process: shape ``(process_count, *x.shape)``."""
    if jax.process_count() == 1:
        return x[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def _where(records: np.ndarray, procs: np.ndarray) -> list[str]:
    """Readable locations: "replicas 0-3 (process 0)", "device 5 (process 1)", ..."""
    out = []
    for p in sorted(set(procs.tolist())):
        mine = records[procs == p]
        reps = [int(r) for r in mine[:, 1] if r >= 0]
        devs = [int(d) for d in mine[:, 2] if d >= 0]
        if reps:
            what = f"replica{'s' if len(set(reps)) > 1 else ''} {ranges(reps)}"
        elif devs:
            what = f"device{'s' if len(set(devs)) > 1 else ''} {ranges(devs)}"
        else:
            what = "host"
        out.append(f"{what} (process {p})")
    return out


def assert_replicas_in_sync(
    tree: Any, *, host_counters: Mapping[str, int] | None = None
) -> dict[str, int]:
    """Checks that every replica and process holds the same post-local SGD step counters.

    Post-local SGD chooses its collectives from its step counters: the global or the
    node-local gradient mean from ``PostLocalSGDState.iter``, the averaging steps from
    ``ModelAveragerState.step``. If replicas disagree, they run different collectives
    and the next one deadlocks (a hang, not an error). This gathers the counters found
    in ``tree`` (see :func:`step_counters`), one int per replica, from every process, and
    raises :class:`ReplicasOutOfSyncError` naming the values and where each was found.

    Cheap: a few integers; on one process no collective at all, on several processes two
    tiny all-gathers. It waits for the counters to be computed, so call it at natural
    sync points: after restoring a checkpoint (:func:`restore_checkpoint` does), before
    the first step, or every few hundred steps. With several processes, every process
    must call it (it is a collective); all of them then raise, or none.

    Args:
      tree: a pytree holding the states to check, e.g. the (replicated) optimizer state,
        or ``{"params": ..., "opt_state": ...}``.
      host_counters: host-side values that must also agree across processes, e.g.
        ``{"data position": step}``.

    Returns:
      The agreed value of each counter, by path (and the ``host_counters``).

    Raises:
      ReplicasOutOfSyncError: when a counter differs between replicas or processes, or
        the processes hold differently structured trees.

    Example:
      >>> import jax.numpy as jnp, optax, lsgd_jax
      >>> mesh = lsgd_jax.make_mesh(2, 4)
      >>> tx = optax.chain(lsgd_jax.post_local_sgd(4), optax.sgd(0.1),
      ...     lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, warmup_steps=4)))
      >>> opt_state = lsgd_jax.replicate(tx.init(jnp.zeros(3)), mesh)
      >>> lsgd_jax.assert_replicas_in_sync(opt_state)
      {'[0].iter': 0, '[2].step': 0}
      >>> bad = (opt_state[0].replace(iter=opt_state[0].iter.at[5].set(3)), *opt_state[1:])
      >>> lsgd_jax.assert_replicas_in_sync(bad)
      Traceback (most recent call last):
      ...
      lsgd_jax.mesh._sync.ReplicasOutOfSyncError: Replicas are out of sync: ...
    """
    counters = step_counters(tree)
    keys = list(counters) + list(host_counters or {})
    names = list(counters) + [f"host counter {k!r}" for k in (host_counters or {})]
    records: list[tuple[int, int, int, int]] = []
    for i, x in enumerate(counters.values()):
        records.extend(_local_records(i, x))
    for j, v in enumerate((host_counters or {}).values()):
        records.append((len(counters) + j, -1, -1, int(v)))
    local = np.asarray(records, np.int64).reshape(-1, _FIELDS)

    # First the shapes of what each process holds, then the values themselves.
    digest = zlib.crc32("\n".join(names).encode())
    header = _allgather(np.asarray([len(local), digest], np.int64))
    if len({tuple(h) for h in header.tolist()}) > 1:
        raise ReplicasOutOfSyncError(
            "Replicas are out of sync: the processes hold different states. "
            + "; ".join(
                f"process {p}: {n} counter values (structure digest {d:#010x})"
                for p, (n, d) in enumerate(header.tolist())
            )
            + f". Here (process {jax.process_index()}) the counters are {names}. Build the "
            "state the same way on every process (same optimizer, same replicate(...)).",
            {},
        )
    gathered = _allgather(local)  # (processes, records, fields)
    procs = np.repeat(np.arange(gathered.shape[0]), gathered.shape[1])
    flat = gathered.reshape(-1, _FIELDS)

    agreed: dict[str, int] = {}
    bad: dict[str, dict[int, list[str]]] = {}
    for i, (key, name) in enumerate(zip(keys, names)):
        mask = flat[:, 0] == i
        values = sorted(set(flat[mask, 3].tolist()))
        if len(values) == 1:
            agreed[key] = int(values[0])
            continue
        bad[name] = {
            int(v): _where(flat[mask & (flat[:, 3] == v)], procs[mask & (flat[:, 3] == v)])
            for v in values
        }
    if bad:
        lines = [
            f"{name} is " + "; ".join(f"{v} on {', '.join(where)}" for v, where in by_value.items())
            for name, by_value in bad.items()
        ]
        raise ReplicasOutOfSyncError(
            "Replicas are out of sync: "
            + ". ".join(lines)
            + ". Every replica must hold the same step counters, or they take different "
            "branches (global or node-local mean, averaging or not) and the next "
            "collective deadlocks. Restore every process from the same checkpoint step, "
            "and build the optimizer state once, with lsgd_jax.replicate(tx.init(params), "
            "mesh).",
            bad,
        )
    return agreed
