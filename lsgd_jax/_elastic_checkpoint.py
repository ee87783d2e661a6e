"""Checkpoints during an elastic run: saved by the live processes, resumed onto any count.

:class:`lsgd_jax.elastic.ElasticLoop` with ``checkpoint_dir`` and ``checkpoint_every``
saves, at the start of every step ``k`` with ``k % checkpoint_every == 0`` (``k > 0``),
the state the step starts from: ``{"params": ..., "opt_state": ...}`` with one entry
per live replica (the step counters are in the optimizer state), as checkpoint ``k`` in
the format of :func:`~lsgd_jax.save_checkpoint`. The save is part of the step's
attempt: the live processes gather the replicas (a collective of the attempt, so a
death fails it and the attempt, save included, runs again over the survivors), and the
lowest live process writes them with orbax, asynchronously (the write overlaps the
step; it is waited for before this process's next save and at the end of the run).

Atomic across a membership change: orbax writes into ``<k>.orbax-checkpoint-tmp`` and
renames it to ``<k>`` once complete; only such finalized folders count as steps
(:func:`latest_step`). A writer that dies mid-save leaves the temporary folder, which
is never listed; the retried attempt (or the next save) writes the step anew (orbax
removes a stale temporary folder of its step first). A step already finalized (by an
attempt that failed after its save) is not written twice.

:meth:`Checkpoints.resume` restores the newest finalized step at the start of a job
(no membership recorded yet in the coordination service's store): every process
restores the step process 0 found, onto a mesh of all the job's processes, with
``restore_checkpoint(..., resize=True)``, so a job may resume on another number of
processes than the one that saved.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from lsgd_jax import _checkpoint, _validate
from lsgd_jax import _checkpoint_config as _config
from lsgd_jax import _checkpoint_files as _files

logger = logging.getLogger("lsgd_jax.elastic")


def check_args(checkpoint_dir: Any, checkpoint_every: Any) -> tuple[str | None, int | None]:
    """ElasticLoop's checkpoint arguments as ``(absolute folder, every)`` or ``(None,
    None)``; a clear error naming the bad value otherwise.

    Example:
      >>> from lsgd_jax._elastic_checkpoint import check_args
      >>> check_args(None, None)
      (None, None)
      >>> check_args("/tmp/ckpt", 0)
      Traceback (most recent call last):
      ...
      ValueError: ElasticLoop: checkpoint_every must be a positive int, got 0; use 1 or more.
    """
    if checkpoint_dir is None:
        if checkpoint_every is not None:
            raise ValueError(
                f"ElasticLoop: checkpoint_every={checkpoint_every!r} needs checkpoint_dir "
                "(the folder to save into), e.g. checkpoint_dir='/ckpt'."
            )
        return None, None
    if not isinstance(checkpoint_dir, (str, os.PathLike)) or not os.fspath(checkpoint_dir):
        raise TypeError(
            "ElasticLoop: checkpoint_dir must be a folder path (a non-empty str or "
            f"os.PathLike) or None, got {checkpoint_dir!r}."
        )
    if checkpoint_every is None:
        raise ValueError(
            f"ElasticLoop: checkpoint_dir={os.fspath(checkpoint_dir)!r} needs "
            "checkpoint_every (save every this many committed steps), e.g. checkpoint_every=100."
        )
    every = _validate.positive_int(checkpoint_every, "ElasticLoop: checkpoint_every")
    path = os.path.abspath(os.fspath(checkpoint_dir))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"ElasticLoop: checkpoint_dir={path!r} exists and is not a folder.")
    _checkpoint._ocp()  # ImportError now, with the install hint, if orbax is missing
    return path, every


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest finalized and readable checkpoint step under ``directory``, or None.

    Only folders named by a step alone count (orbax's finalized ones): a save in
    progress or interrupted (``<k>.orbax-checkpoint-tmp``), a set-aside damaged step
    (``<k>.unreadable``) or any other entry never does. A listing and small reads: any
    process may call it alone.

    Example:
      >>> import tempfile
      >>> from lsgd_jax._elastic_checkpoint import latest_step
      >>> with tempfile.TemporaryDirectory() as d:
      ...     os.makedirs(os.path.join(d, "4.orbax-checkpoint-tmp"))
      ...     print(latest_step(d))
      None
    """
    if not os.path.isdir(directory):
        return None
    names = {n for n in os.listdir(directory) if n.isdigit()}
    for step in reversed(_checkpoint._steps(directory)):
        if str(step) in names and _files.damage(_files.step_dir(directory, step)) is None:
            return step
    return None


def _gathered(state: Any) -> dict[str, Any]:
    """Every replica's state on this process, as numpy arrays (a collective of the live
    processes: a death fails it). Orbax writes numpy leaves from the primary process
    alone; a restore reads them onto any sharding."""
    from jax.experimental import multihost_utils

    params, opt_state = state
    tree = multihost_utils.process_allgather({"params": params, "opt_state": opt_state}, True)
    return jax.tree.map(np.asarray, tree)


class Checkpoints:
    """The checkpoints of one elastic loop: when to save, the pending write, resume.

    Args:
      directory: the folder (one subfolder per saved step).
      every: save at the start of every step that is a multiple of it (not step 0).
    """

    def __init__(self, directory: str, every: int) -> None:
        self.directory, self.every = directory, every
        self._pending: Any = None  # (manager, step folder) of this process's write

    def due(self, step: int) -> bool:
        """Whether the attempt at ``step`` saves: the same answer on every process, a
        joiner's included (so a step resumed from a checkpoint saves again, and the
        writer finds it finalized)."""
        return step > 0 and step % self.every == 0

    def save(self, state: Any, step: int, processes: tuple[int, ...]) -> None:
        """Inside an attempt: gathers the live replicas and, on the lowest live process,
        starts writing checkpoint ``step`` (unless it is already finalized)."""
        self.wait()  # before the gather: no two writes of one step overlap
        tree = _gathered(state)
        if jax.process_index() != min(processes):
            return
        if finalized(self.directory, step):
            return
        ocp = _checkpoint._ocp()
        paths, leaves, treedef = _checkpoint._flatten(tree)
        manifest = {
            "paths": paths,
            "shapes": [list(np.shape(x)) for x in leaves],
            "dtypes": [str(np.dtype(x.dtype)) for x in leaves],
            "treedef": str(treedef),
            "static": _config.static_config(tree),
            "skeleton": _config.skeleton(tree),
        }
        arrays = dict(zip(_checkpoint._leaf_names(len(leaves)), leaves))
        me = jax.process_index()
        os.makedirs(self.directory, exist_ok=True)  # (orbax's create=True needs all processes)
        options = ocp.CheckpointManagerOptions(
            create=False,
            enable_async_checkpointing=True,
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                primary_host=me, active_processes={me}, barrier_sync_key_prefix=f"lsgd{me}"
            ),
        )
        manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=(_checkpoint._ARRAYS, _checkpoint._MANIFEST)
        )
        args = {
            _checkpoint._ARRAYS: ocp.args.StandardSave(arrays),
            _checkpoint._MANIFEST: ocp.args.JsonSave(manifest),
        }
        manager.save(step, args=ocp.args.Composite(**args), force=True)
        self._pending = (manager, _files.step_dir(self.directory, step))

    def wait(self) -> None:
        """Waits for this process's write in flight (if any) to be finalized, then
        records its files' sizes (the check of :func:`latest_step`)."""
        if self._pending is None:
            return
        manager, step_dir = self._pending
        self._pending = None
        try:
            manager.wait_until_finished()
        finally:
            manager.close()
        if os.path.isdir(step_dir):
            _files.write_file_sizes(step_dir)
            logger.info("lsgd_jax.elastic: saved checkpoint %s", step_dir)

    def resume(self, init_params: Any, tx: Any) -> tuple[int, tuple[Any, Any]] | None:
        """At the start of a job: ``(step, (params, opt_state))`` restored from the newest
        finalized step (the one process 0 found), or None when there is none. A
        collective of all the job's processes."""
        from jax.experimental import multihost_utils

        from lsgd_jax._mesh import replicate

        found = latest_step(self.directory) if jax.process_index() == 0 else None
        step = int(multihost_utils.broadcast_one_to_all(np.int32(-1 if found is None else found)))
        if step < 0:
            return None
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        mesh = Mesh(np.array(devices).reshape(jax.process_count(), -1), ("node", "local"))
        target = {
            "params": replicate(init_params, mesh),
            "opt_state": replicate(tx.init(init_params), mesh),
        }
        tree = _checkpoint.restore_checkpoint(self.directory, target, step, resize=True)
        logger.warning(
            "lsgd_jax.elastic: resuming at step %d from checkpoint %s", step, self.directory
        )
        return step, (tree["params"], tree["opt_state"])


def finalized(directory: str, step: int) -> bool:
    """Whether checkpoint ``step`` is finalized under ``directory``."""
    return os.path.isdir(_files.step_dir(directory, step))
