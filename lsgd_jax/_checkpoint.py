"""Checkpoints of a whole training state with orbax-checkpoint, one step per folder.

The state (per-replica params, optimizer states with their ``PostLocalSGDState`` and
``ModelAveragerState``, step counters) is saved as its list of array leaves plus a small
JSON manifest of their paths, shapes and dtypes. Restoring needs a *target* tree of the
same structure (e.g. ``replicate(tx.init(params), mesh)``): it supplies the static
metadata the arrays do not carry (the axis names in ``PostLocalSGDState``, the averager
in ``ModelAveragerState``) and the shardings to restore onto, so each process reads only
its own shards.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import jax
import numpy as np

from lsgd_jax._sync import assert_replicas_in_sync

_ARRAYS, _MANIFEST = "arrays", "manifest"


def _ocp():
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover - exercised only without orbax
        raise ImportError(
            "lsgd_jax checkpoints need orbax-checkpoint: pip install 'lsgd_jax[checkpoint]'."
        ) from e
    return ocp


def _manager(directory: str | os.PathLike, max_to_keep: int | None = None, *, write: bool):
    ocp = _ocp()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        create=write,  # creating the folder is a barrier: only when every process saves
        enable_async_checkpointing=False,
    )
    return ocp.CheckpointManager(
        os.path.abspath(os.fspath(directory)), options=options, item_names=(_ARRAYS, _MANIFEST)
    )


def _flatten(tree: Any) -> tuple[list[str], list[Any], Any]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    return paths, [x for _, x in flat], treedef


def _leaf_names(n: int) -> list[str]:
    return [f"leaf_{i:05d}" for i in range(n)]


def _as_array(path: str, x: Any) -> Any:
    if isinstance(x, (jax.Array, np.ndarray)):
        return x
    if isinstance(x, (bool, int, float, complex, np.generic)):
        return np.asarray(x)
    raise TypeError(
        f"save_checkpoint: leaf {path or '(root)'} is a {type(x).__name__}; a checkpoint "
        "holds arrays and Python scalars only. Keep other objects out of the tree (or make "
        "them static pytree metadata)."
    )


def save_checkpoint(
    directory: str | os.PathLike, step: int, tree: Any, *, max_to_keep: int | None = None
) -> str:
    """Saves ``tree`` as checkpoint ``step`` under ``directory`` (blocking, atomic).

    Every array leaf is written; a ``jax.Array`` sharded over several processes is
    written by the processes that hold its shards, so with several processes every
    process must call this (with the same ``step``). The checkpoint appears under
    ``directory/<step>`` only once complete: a process killed mid-save leaves no
    partial checkpoint that :func:`restore_checkpoint` would pick up.

    Args:
      directory: the folder holding one subfolder per step (created if missing).
      step: the training step this checkpoint resumes at (a non-negative int).
      tree: a pytree of arrays and Python scalars, e.g. ``{"params": params,
        "opt_state": opt_state}`` with per-replica values from :func:`replicate`.
      max_to_keep: keep only the newest this many checkpoints (None: all).

    Returns:
      The path of the new checkpoint folder.

    Example:
      >>> import tempfile, jax.numpy as jnp, optax, lsgd_jax
      >>> mesh = lsgd_jax.make_mesh(2, 4)
      >>> tx = optax.chain(lsgd_jax.post_local_sgd(4), optax.sgd(0.1))
      >>> state = {"params": lsgd_jax.replicate(jnp.zeros(3), mesh),
      ...          "opt_state": lsgd_jax.replicate(tx.init(jnp.zeros(3)), mesh)}
      >>> with tempfile.TemporaryDirectory() as ckpt_dir:
      ...     path = lsgd_jax.save_checkpoint(ckpt_dir, 10, state)
      ...     lsgd_jax.latest_checkpoint_step(ckpt_dir)
      10
    """
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"save_checkpoint: step must be a non-negative int, got {step!r}.")
    ocp = _ocp()
    paths, leaves, treedef = _flatten(tree)
    leaves = [_as_array(p, x) for p, x in zip(paths, leaves)]
    manifest = {
        "paths": paths,
        "shapes": [list(np.shape(x)) for x in leaves],
        "dtypes": [str(np.dtype(x.dtype)) for x in leaves],
        "treedef": str(treedef),
    }
    with _manager(directory, max_to_keep, write=True) as manager:
        manager.save(
            int(step),
            args=ocp.args.Composite(
                **{
                    _ARRAYS: ocp.args.StandardSave(dict(zip(_leaf_names(len(leaves)), leaves))),
                    _MANIFEST: ocp.args.JsonSave(manifest),
                }
            ),
            force=True,
        )
        manager.wait_until_finished()
        return os.fspath(manager.directory / str(int(step)))


def latest_checkpoint_step(directory: str | os.PathLike) -> int | None:
    """The newest complete checkpoint step under ``directory``, or None if there is none.

    A directory listing, not a collective: any process may call it alone. Folders of
    saves that did not complete (a process killed mid-save) are not counted.

    Args:
      directory: the folder given to :func:`save_checkpoint`.

    Returns:
      The largest saved step, or None.

    Example:
      >>> import tempfile, lsgd_jax
      >>> with tempfile.TemporaryDirectory() as empty:
      ...     print(lsgd_jax.latest_checkpoint_step(empty))
      None
    """
    steps = _steps(directory)
    return max(steps) if steps else None


def _steps(directory: str | os.PathLike) -> list[int]:
    """The complete checkpoints' steps: a listing, no collective (any process may ask)."""
    if not os.path.isdir(directory):
        return []
    return sorted(_ocp().utils.checkpoint_steps(os.path.abspath(os.fspath(directory))))


def _abstract(path: str, x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        if x.sharding is None:
            raise ValueError(
                f"restore_checkpoint: target leaf {path or '(root)'} is a ShapeDtypeStruct "
                "without a sharding; give it one (e.g. from lsgd_jax.replicate), or pass an "
                "array."
            )
        return x
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return np.asarray(_as_array(path, x))


def restore_checkpoint(
    directory: str | os.PathLike,
    target: Any,
    step: int | None = None,
    *,
    check_in_sync: bool = True,
) -> Any:
    """Restores a checkpoint saved by :func:`save_checkpoint` into the shape of ``target``.

    ``target`` is a tree of the same structure as the saved one, e.g. the freshly
    initialized state ``{"params": replicate(params, mesh), "opt_state":
    replicate(tx.init(params), mesh)}``: it provides the static metadata that the arrays
    do not carry (such as the axis names of ``PostLocalSGDState`` and the averager of
    ``ModelAveragerState``) and, for each ``jax.Array`` or ``jax.ShapeDtypeStruct`` leaf,
    the sharding to restore onto (each process reads only its own shards). Host leaves
    (numpy, Python scalars) come back as numpy arrays. Paths, shapes and dtypes must
    match the saved ones.

    With several processes every process must call this. Afterwards
    :func:`assert_replicas_in_sync` checks that every replica and process restored the
    same step counters (unless ``check_in_sync=False``), so that a process that restored
    another step fails here instead of hanging in the first collective.

    Args:
      directory: the folder given to :func:`save_checkpoint`.
      target: a pytree like the saved one (arrays, ShapeDtypeStructs with shardings,
        or Python scalars).
      step: the step to restore; None: the latest (see :func:`latest_checkpoint_step`).
      check_in_sync: run :func:`assert_replicas_in_sync` on the result.

    Returns:
      The restored pytree, with ``target``'s structure and shardings.

    Raises:
      FileNotFoundError: no checkpoint (or not ``step``) under ``directory``.
      ValueError: the saved leaves do not match ``target``'s paths, shapes or dtypes.
      ReplicasOutOfSyncError: the restored step counters differ between replicas or
        processes.

    Example:
      >>> import tempfile, jax.numpy as jnp, optax, lsgd_jax
      >>> mesh = lsgd_jax.make_mesh(2, 4)
      >>> tx = optax.chain(lsgd_jax.post_local_sgd(4), optax.sgd(0.1))
      >>> fresh = lambda: {"params": lsgd_jax.replicate(jnp.zeros(3), mesh),
      ...                  "opt_state": lsgd_jax.replicate(tx.init(jnp.zeros(3)), mesh)}
      >>> state = fresh()
      >>> state["params"] = state["params"] + 1.0
      >>> with tempfile.TemporaryDirectory() as ckpt_dir:
      ...     _ = lsgd_jax.save_checkpoint(ckpt_dir, 3, state)
      ...     restored = lsgd_jax.restore_checkpoint(ckpt_dir, fresh())
      >>> restored["params"][0], restored["opt_state"][0].start_localSGD_iter
      (Array([1., 1., 1.], dtype=float32), 4)
    """
    ocp = _ocp()
    paths, leaves, treedef = _flatten(target)
    steps = _steps(directory)
    if step is None and not steps:
        raise FileNotFoundError(f"restore_checkpoint: no complete checkpoint under {directory!r}.")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise FileNotFoundError(
            f"restore_checkpoint: no checkpoint of step {step} under {directory!r}; "
            f"saved steps: {steps}."
        )
    with _manager(directory, write=False) as manager:
        manifest = manager.restore(
            step, args=ocp.args.Composite(**{_MANIFEST: ocp.args.JsonRestore()})
        )[_MANIFEST]
        abstract = [_abstract(p, x) for p, x in zip(paths, leaves)]
        _check_manifest(manifest, paths, abstract, str(treedef), step)
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                **{
                    _ARRAYS: ocp.args.StandardRestore(
                        dict(zip(_leaf_names(len(abstract)), abstract))
                    )
                }
            ),
        )[_ARRAYS]
    names = _leaf_names(len(abstract))
    tree = jax.tree_util.tree_unflatten(treedef, [restored[n] for n in names])
    if check_in_sync:
        assert_replicas_in_sync(tree)
    return tree


def _check_manifest(manifest: dict, paths: list[str], abstract: list[Any], treedef: str, step):
    saved = manifest["paths"]
    if len(saved) != len(paths):
        missing = [p for p in paths if p not in saved]
        extra = [p for p in saved if p not in paths]
        raise ValueError(
            f"restore_checkpoint: checkpoint {step} holds {len(saved)} leaves, the target "
            f"{len(paths)}. In the target but not saved: {missing or 'none'}; saved but not "
            f"in the target: {extra or 'none'}. Build the target exactly as the saved tree "
            "was built."
        )
    for p, shape, dtype, x in zip(paths, manifest["shapes"], manifest["dtypes"], abstract):
        if tuple(shape) != tuple(np.shape(x)) or dtype != str(np.dtype(x.dtype)):
            raise ValueError(
                f"restore_checkpoint: leaf {p or '(root)'} was saved as {dtype}{list(shape)} "
                f"but the target is {np.dtype(x.dtype)}{list(np.shape(x))}. Per-replica "
                "values have a leading axis of one entry per replica: restore on a mesh "
                "with as many replicas as the run that saved it."
            )
    # Same leaves, shapes and dtypes: differences in names or static metadata (another
    # averager period, a state class that now names its fields) only warn.
    renamed = [(a, b) for a, b in zip(saved, paths) if a != b]
    if renamed or manifest.get("treedef") != treedef:
        warnings.warn(
            f"restore_checkpoint: the target's structure differs from checkpoint {step}'s "
            f"in names or static metadata only; the target's are used. Renamed leaves "
            f"(saved -> target): {renamed or 'none'}.\n"
            f"  saved:  {manifest.get('treedef')}\n  target: {treedef}",
            stacklevel=3,
        )
