"""Checkpoints of a whole training state with orbax-checkpoint, one step per folder.

The state (per-replica params, optimizer states with their ``PostLocalSGDState`` and
``ModelAveragerState``, step counters) is saved as its list of array leaves plus a small
JSON manifest of their paths, shapes and dtypes. Restoring needs a *target* tree of the
same structure (e.g. ``replicate(tx.init(params), mesh)``): it supplies the static
metadata the arrays do not carry (the axis names in ``PostLocalSGDState``, the averager
in ``ModelAveragerState``) and the shardings to restore onto, so each process reads only
its own shards.

A damaged newest step is skipped (``_checkpoint_files``), and a restore warns only when
the static configuration really changed, one line per changed field
(``_checkpoint_config``). ``resize=True`` restores a checkpoint of N replicas onto M
(``_resize``: which leaves are per replica, and the value each new replica gets).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import jax
import numpy as np

from lsgd_jax._core import _validate
from lsgd_jax.checkpoint import _checkpoint_config as _config
from lsgd_jax.checkpoint import _checkpoint_files as _files
from lsgd_jax.checkpoint import _format, _resize
from lsgd_jax.checkpoint._checkpoint_files import UnreadableCheckpointError
from lsgd_jax.mesh import assert_replicas_in_sync


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
    partial checkpoint that :func:`restore_checkpoint` would pick up. Process 0 then
    writes ``lsgd_jax_files.json`` into the step folder, the size of each of its files,
    by which a later truncation is found without reading the arrays. The manifest records
    the static configuration of the post-local SGD states, compared at restore.

    Args:
      directory: the folder holding one subfolder per step (created if missing).
      step: the training step this checkpoint resumes at (a non-negative int).
      tree: a pytree of arrays and Python scalars, e.g. ``{"params": params,
        "opt_state": opt_state}`` with per-replica values from :func:`replicate`.
      max_to_keep: keep only the newest this many checkpoints (None: all).

    Returns:
      The path of the new checkpoint folder.

    Raises:
      ValueError: ``step`` is not a non-negative int.
      TypeError: a leaf is neither an array nor a Python scalar.

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
    step = _validate.nonnegative_int(step, "save_checkpoint: step")
    _format.ocp()  # ImportError with the install hint before anything else
    paths, leaves, treedef = _format.flatten(tree)
    leaves = [_as_array(p, x) for p, x in zip(paths, leaves)]
    manifest = _format.manifest(tree, paths, leaves, treedef)
    _files.set_aside_if_damaged(directory, int(step))
    with _format.manager(directory, max_to_keep) as manager:
        manager.save(int(step), args=_format.save_args(leaves, manifest), force=True)
        manager.wait_until_finished()
        step_dir = os.fspath(manager.directory / str(int(step)))
    if jax.process_index() == 0:  # the step folder is final: every process wrote its files
        _files.write_file_sizes(step_dir)
    if jax.process_count() > 1:  # no process returns (and may restore) before the list exists
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"lsgd_jax save_checkpoint {int(step)}")
    return step_dir


def latest_checkpoint_step(directory: str | os.PathLike) -> int | None:
    """The newest complete and readable checkpoint step under ``directory``, or None.

    A directory listing plus small reads, not a collective: any process may call it
    alone. Folders of saves that did not complete (a process killed mid-save) are not
    counted; a step whose files were damaged afterwards (truncated, missing, or JSON that
    does not parse: see :func:`restore_checkpoint`) is skipped with a warning that names
    the file, and the next older one is considered. The arrays are not read.

    Args:
      directory: the folder given to :func:`save_checkpoint`.

    Returns:
      The largest saved step that passes the check, or None.

    Example:
      >>> import tempfile, lsgd_jax
      >>> with tempfile.TemporaryDirectory() as empty:
      ...     print(lsgd_jax.latest_checkpoint_step(empty))
      None
    """
    for step in reversed(_format.steps(directory)):
        damage = _files.damage(_files.step_dir(directory, step))
        if damage is None:
            return step
        warnings.warn(_files.skipped_message("latest_checkpoint_step", step, *damage), stacklevel=2)
    return None


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
    strict: bool = False,
    resize: bool = False,
) -> Any:
    """Restores a checkpoint saved by :func:`save_checkpoint` into the shape of ``target``.

    ``target`` is built exactly as the saved tree, e.g. ``{"params": replicate(params,
    mesh), "opt_state": replicate(tx.init(params), mesh)}``: it supplies what the arrays
    do not carry (axis names, the averager) and the shardings to read onto. A changed
    static setting warns per field; a damaged step is skipped, with a warning, for the
    next older one. Every process must call it. More: docs/checkpoints.md.

    Args:
      directory: the folder given to :func:`save_checkpoint`.
      target: a pytree like the saved one (arrays, ShapeDtypeStructs with shardings,
        or Python scalars).
      step: the step to restore; None: the newest readable one (see
        :func:`latest_checkpoint_step`).
      check_in_sync: run :func:`assert_replicas_in_sync` on the result.
      strict: raise instead of warning when names or static metadata differ.
      resize: allow another number of replicas than the checkpoint's: a per-replica
        floating leaf gets the saved replicas' mean, an integer one the saved value.

    Returns:
      The restored pytree, with ``target``'s structure and shardings.

    Raises:
      FileNotFoundError: no checkpoint (or not ``step``) under ``directory``.
      UnreadableCheckpointError: ``step`` (or, with ``step=None``, every saved step) has
        damaged files; a subclass of ValueError.
      ValueError: the saved leaves do not match ``target``'s paths, shapes or dtypes
        (with ``resize=True``: shapes beyond the leading replica axis, or two replica
        counts in one target); or, with ``strict=True``, its names or static metadata.
      ReplicasOutOfSyncError: the restored step counters differ between replicas or
        processes (with ``resize=True``: an integer leaf between the saved replicas).

    Example:
      >>> import tempfile, jax.numpy as jnp, optax, lsgd_jax
      >>> mesh = lsgd_jax.make_mesh(2, 4)
      >>> tx = optax.chain(lsgd_jax.post_local_sgd(4), optax.sgd(0.1))
      >>> fresh = lambda: {"params": lsgd_jax.replicate(jnp.zeros(3), mesh),
      ...                  "opt_state": lsgd_jax.replicate(tx.init(jnp.zeros(3)), mesh)}
      >>> state = dict(fresh(), params=fresh()["params"] + 1.0)
      >>> with tempfile.TemporaryDirectory() as ckpt_dir:
      ...     _ = lsgd_jax.save_checkpoint(ckpt_dir, 3, state)
      ...     restored = lsgd_jax.restore_checkpoint(ckpt_dir, fresh(), strict=True)
      >>> restored["params"][0], restored["opt_state"][0].start_localSGD_iter
      (Array([1., 1., 1.], dtype=float32), 4)
    """
    paths, leaves, treedef = _format.flatten(target)
    abstract = [_abstract(p, x) for p, x in zip(paths, leaves)]
    steps = _saved_steps(directory, step)
    skipped: list[tuple[int, _files.Damaged]] = []
    # A Checkpointer reads one step folder; a CheckpointManager would first read the
    # metadata of every step, and log an error for each damaged one.
    with _reader() as reader:
        for candidate in [step] if step is not None else steps[::-1]:
            try:
                restored, lines = _restore_step(
                    reader,
                    directory,
                    candidate,
                    (paths, abstract, str(treedef)),
                    target,
                    strict,
                    resize,
                )
                break
            except _files.Damaged as d:
                if step is not None:
                    raise _unreadable(directory, step, steps, d) from d.__cause__
                warnings.warn(
                    _files.skipped_message("restore_checkpoint", candidate, *d.args), stacklevel=2
                )
                skipped.append((candidate, d))
        else:
            raise UnreadableCheckpointError(
                f"restore_checkpoint: no readable checkpoint under {directory!r}: "
                + "; ".join(f"step {s}: {d.path} {d.reason}" for s, d in skipped)
                + ". Put back an intact copy of a step folder, or start afresh.",
                None,
                *skipped[0][1].args,
            ) from skipped[0][1].__cause__
    if lines:
        warnings.warn(_config.mismatch(candidate, lines, strict=False), stacklevel=2)
    names = _format.leaf_names(len(abstract))
    leaves = [restored[n] for n in names]
    if resize:
        leaves = _resize.apply(candidate, paths, leaves, abstract, target)
    tree = jax.tree_util.tree_unflatten(treedef, leaves)
    if check_in_sync:
        assert_replicas_in_sync(tree)
    return tree


def _reader() -> Any:
    """A reader of one step folder that waits for no other process: each process reads
    its own shards (orbax's default ends each read with a barrier of every device of
    the job, which an elastic run's dead processes never reach). The processes agree
    on the step beforehand, or ``check_in_sync`` finds out."""
    ocp = _format.ocp()
    me = jax.process_index()
    alone = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    handler = ocp.CompositeCheckpointHandler(
        composite_options=ocp.CompositeOptions(multiprocessing_options=alone)
    )
    return ocp.Checkpointer(handler, multiprocessing_options=alone)


def _saved_steps(directory: Any, step: int | None) -> list[int]:
    """The complete steps under ``directory``; raises if there is none, or not ``step``."""
    steps = _format.steps(directory)
    if step is None and not steps:
        raise FileNotFoundError(f"restore_checkpoint: no complete checkpoint under {directory!r}.")
    if step is not None and step not in steps:
        raise FileNotFoundError(
            f"restore_checkpoint: no checkpoint of step {step} under {directory!r}; "
            f"saved steps: {steps}."
        )
    return steps


def _unreadable(
    directory: str | os.PathLike, step: int, steps: list[int], d: _files.Damaged
) -> UnreadableCheckpointError:
    """The error for a damaged step asked for explicitly, naming the readable ones."""
    others = _files.readable(directory, [s for s in steps if s != step])
    return UnreadableCheckpointError(
        f"restore_checkpoint: checkpoint {step} under {directory!r} is "
        f"unreadable: {d.path} {d.reason}. Files damaged after the save (a "
        "full disk, an interrupted copy) do this; nothing was changed. Restore "
        f"another step (readable: {others or 'none'}; step=None takes the "
        "newest readable one), or put back an intact copy of the folder.",
        step,
        d.path,
        d.reason,
    )


def _restore_step(
    reader: Any,
    directory: str | os.PathLike,
    step: int,
    flat: tuple[list[str], list[Any], str],
    target: Any,
    strict: bool,
    resize: bool,
) -> tuple[dict[str, Any], list[str]]:
    """The arrays of ``step`` and the differences to report; raises _files.Damaged if unreadable."""
    ocp = _format.ocp()
    paths, abstract, treedef = flat
    step_dir = _files.step_dir(directory, step)
    damage = _files.damage(step_dir)
    if damage is not None:
        raise _files.Damaged(*damage)
    try:
        manifest = reader.restore(
            step_dir, args=ocp.args.Composite(**{_format.MANIFEST: ocp.args.JsonRestore()})
        )[_format.MANIFEST]
    except Exception as e:
        raise _files.Damaged(
            os.path.join(step_dir, _format.MANIFEST), f"failed to read ({type(e).__name__}: {e})"
        ) from e
    _check_count(manifest, paths, step)
    if resize:  # per-replica leaves are read as saved, resized afterwards (_resize.apply)
        abstract = _resize.read_abstract(manifest, paths, abstract, step)
    else:
        _check_shapes(manifest, paths, abstract)
    lines = _config.differences(manifest, paths, treedef, target)
    if lines and strict:
        raise ValueError(_config.mismatch(step, lines, strict=True))
    names = _format.leaf_names(len(abstract))
    try:
        restored = reader.restore(
            step_dir,
            args=ocp.args.Composite(
                **{_format.ARRAYS: ocp.args.StandardRestore(dict(zip(names, abstract)))}
            ),
        )[_format.ARRAYS]
    except Exception as e:
        message = str(e) if len(str(e)) <= 300 else str(e)[:300] + "…"
        raise _files.Damaged(
            os.path.join(step_dir, _format.ARRAYS),
            f"failed to read ({type(e).__name__}: {message})",
        ) from e
    return restored, lines


def _check_count(manifest: dict, paths: list[str], step: int) -> None:
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


def _check_shapes(manifest: dict, paths: list[str], abstract: list[Any]) -> None:
    for p, shape, dtype, x in zip(paths, manifest["shapes"], manifest["dtypes"], abstract):
        if tuple(shape) != tuple(np.shape(x)) or dtype != str(np.dtype(x.dtype)):
            raise ValueError(
                f"restore_checkpoint: leaf {p or '(root)'} was saved as {dtype}{list(shape)} "
                f"but the target is {np.dtype(x.dtype)}{list(np.shape(x))}. Per-replica "
                "values have a leading axis of one entry per replica: restore on a mesh "
                "with as many replicas as the run that saved it, or pass resize=True to "
                "restore onto another number of replicas (docs/checkpoints.md)."
            )
