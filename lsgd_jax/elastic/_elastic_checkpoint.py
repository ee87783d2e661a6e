"""Checkpoints during an elastic run: saved by the live processes, resumed onto any count.

:class:`lsgd_jax.elastic.ElasticLoop` with ``checkpoint_dir`` and ``checkpoint_every``
saves, at the start of every step ``k`` with ``k % checkpoint_every == 0`` (``k > 0``),
the state the step starts from: ``{"params": ..., "opt_state": ...}`` (and
``"model_state"`` when the loop has model state) with one entry per live replica (the
step counters are in the optimizer state), as checkpoint ``k`` in
the format of :func:`~lsgd_jax.save_checkpoint`. The save is part of the step's
attempt: the live processes gather the replicas (a collective of the attempt, so a
death fails it and the attempt, save included, runs again over the survivors), and the
lowest live process hands them to a writer process of its own, which writes them with
orbax while training goes on (asynchronously: never waited for inside a step, where
the others' collectives would time out; ``ElasticLoop.shutdown`` and the process's
exit wait for it).

Atomic across a membership change: the writer saves into a staging folder of its own
(``.lsgd-staging-<k>-<pid>``; orbax finalizes the step there) and then renames the
finalized folder to ``<k>``; only folders named by a step alone are checkpoints
(:func:`latest_step`). A writer killed mid-save leaves its staging folder, which is
never listed; the retried attempt (or the next save) writes the step anew, and if two
writers of one step both finish, the first rename wins. A step already finalized is
not written again.

:meth:`Checkpoints.resume` restores the newest finalized step at the start of a job
(no membership recorded yet in the coordination service's store): every process
restores the step process 0 found, onto a mesh of all the job's processes, with
``restore_checkpoint(..., resize=True)``, so a job may resume on another number of
processes than the one that saved.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from lsgd_jax import checkpoint
from lsgd_jax._core import _validate
from lsgd_jax.elastic._attempts import loop_axes

logger = logging.getLogger("lsgd_jax.elastic")


def check_args(checkpoint_dir: Any, checkpoint_every: Any) -> tuple[str | None, int | None]:
    """ElasticLoop's checkpoint arguments as ``(absolute folder, every)`` or ``(None,
    None)``; a clear error naming the bad value otherwise.

    Example:
      >>> from lsgd_jax.elastic._elastic_checkpoint import check_args
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
    checkpoint.require_orbax()  # ImportError now, with the install hint, if orbax is missing
    return path, every


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest finalized and readable checkpoint step under ``directory``, or None.

    Only folders named by a step alone count (orbax's finalized ones): a save in
    progress or interrupted (``<k>.orbax-checkpoint-tmp``), a set-aside damaged step
    (``<k>.unreadable``) or any other entry never does. A listing and small reads: any
    process may call it alone.

    Example:
      >>> import tempfile
      >>> from lsgd_jax.elastic._elastic_checkpoint import latest_step
      >>> with tempfile.TemporaryDirectory() as d:
      ...     os.makedirs(os.path.join(d, "4.orbax-checkpoint-tmp"))
      ...     print(latest_step(d))
      None
    """
    return checkpoint.latest_readable_step(directory)


def _gathered(state: Any) -> dict[str, Any]:
    """Every replica's state on this process, as numpy arrays (a collective of the live
    processes: a death fails it, with a JaxRuntimeError like any collective of a step,
    so that the attempt is retried).

    A state on one process's devices alone (the sole live process) is read as it is:
    ``process_allgather`` would stack a fully addressable array from every process of
    the job, dead ones included, and fail every retry (seen in the soak)."""
    from jax.experimental import multihost_utils

    def gather(x):
        if getattr(x, "is_fully_addressable", True):
            return np.asarray(x)
        return multihost_utils.process_allgather(x, True)

    try:
        tree = jax.tree.map(gather, as_dict(state))
    except ValueError as e:  # gloo's failed all-gather ("UNKNOWN: Gloo AllGather failed")
        if "Gloo" not in str(e) and not str(e).startswith(_STATUS):
            raise
        raise jax.errors.JaxRuntimeError(str(e)) from e
    return jax.tree.map(np.asarray, tree)


def as_dict(state: tuple[Any, ...]) -> dict[str, Any]:
    """The loop's state ``(params, [model_state,] opt_state)`` as a checkpoint's tree.

    Example:
      >>> from lsgd_jax.elastic._elastic_checkpoint import as_dict
      >>> sorted(as_dict((1, 2, 3)))
      ['model_state', 'opt_state', 'params']
    """
    params, *model_state, opt_state = state
    tree = {"params": params, "opt_state": opt_state}
    if model_state:
        tree["model_state"] = model_state[0]
    return tree


def as_state(tree: dict[str, Any]) -> tuple[Any, ...]:
    """A checkpoint's tree as the loop's state (the inverse of :func:`as_dict`)."""
    if "model_state" in tree:
        return tree["params"], tree["model_state"], tree["opt_state"]
    return tree["params"], tree["opt_state"]


_STATUS = ("UNKNOWN:", "INTERNAL:", "DEADLINE_EXCEEDED:", "UNAVAILABLE:", "ABORTED:")


class Checkpoints:
    """The checkpoints of one elastic loop: when to save, the writes in flight, resume.

    Args:
      directory: the folder (one subfolder per saved step).
      every: save at the start of every step that is a multiple of it (not step 0).
      shard_over: the loop's FSDP axes (``("local",)``: one replica a process, sharded
        over its devices), how a restored state is laid out; none: one replica a device.
    """

    def __init__(self, directory: str, every: int, shard_over: tuple[str, ...] = ()) -> None:
        self.directory, self.every, self.shard_over = directory, every, shard_over
        self._pending: list[tuple[Any, str, int]] = []  # (writer, staging, step)
        atexit.register(self.wait)  # a normal exit waits for (and reports) the writers

    def due(self, step: int) -> bool:
        """Whether the attempt at ``step`` saves: the same answer on every process, a
        joiner's included (so a step resumed from a checkpoint saves again, and the
        writer finds it finalized)."""
        return step > 0 and step % self.every == 0

    def save(self, state: Any, step: int, processes: tuple[int, ...]) -> None:
        """Inside an attempt: gathers the live replicas and, on the lowest live process,
        starts a writer of checkpoint ``step`` (unless it is finalized or being
        written). Never waits for a writer: that would keep this process from the
        attempt's collectives (the others' would time out)."""
        self.poll()
        tree = _gathered(state)
        if jax.process_index() != min(processes) or finalized(self.directory, step):
            return
        if any(s == step for _, _, s in self._pending):
            return  # this process's writer of this step is still at it
        leaves, manifest = checkpoint.stage(tree)
        child, staging = _start_writer(self.directory, step, leaves, manifest)
        self._pending.append((child, staging, step))

    def poll(self, block: bool = False) -> None:
        """Reaps this process's finished writers (all of them, waiting, with ``block``);
        RuntimeError with the writer's output if one failed."""
        for entry in list(self._pending):
            child, staging, step = entry
            code = child.wait() if block else child.poll()
            if code is None:
                continue
            self._pending.remove(entry)
            if code != 0:
                raise _failed(self.directory, step, staging, code)
            logger.info("lsgd_jax.elastic: saved checkpoint %d in %s", step, self.directory)

    def wait(self) -> None:
        """Waits for this process's writers in flight (at the end, outside any step)."""
        self.poll(block=True)

    def resume(
        self, init_params: Any, tx: Any, init_model_state: Any, num_steps: Any
    ) -> tuple[int, tuple[Any, ...]] | None:
        """At the start of a job: ``(step, (params, [model_state,] opt_state))`` restored
        from the newest finalized step (the one process 0 found), or None when there is
        none. A collective of all the job's processes. ValueError if that step is at or
        past ``num_steps`` (nothing left to run)."""
        from jax.experimental import multihost_utils

        found = latest_step(self.directory) if jax.process_index() == 0 else None
        step = int(multihost_utils.broadcast_one_to_all(np.int32(-1 if found is None else found)))
        if step < 0:
            return None
        if _validate._is_int(num_steps) and step >= num_steps:
            raise ValueError(
                f"ElasticLoop.run: checkpoint_dir {self.directory!r} holds step {step}, at or "
                f"past num_steps={num_steps}: nothing left to run. Pass a larger num_steps "
                "to train on, or another checkpoint_dir to start afresh."
            )
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        mesh = Mesh(np.array(devices).reshape(jax.process_count(), -1), ("node", "local"))
        state = self.restore(init_params, tx, init_model_state, step, mesh)
        logger.warning(
            "lsgd_jax.elastic: resuming at step %d from checkpoint %s", step, self.directory
        )
        return step, state

    def restore(
        self, init_params: Any, tx: Any, init_model_state: Any, step: int, mesh: Mesh
    ) -> tuple[Any, ...]:
        """``(params, [model_state,] opt_state)`` of checkpoint ``step`` over ``mesh``
        (its replicas resized to the mesh's), read by every process of the mesh."""
        from lsgd_jax.mesh import replicate

        inside = self.shard_over

        def place(tree):
            return replicate(tree, mesh, loop_axes(inside), shard_over=inside or None)

        target = {"params": place(init_params), "opt_state": place(tx.init(init_params))}
        if init_model_state is not None:
            target["model_state"] = place(init_model_state)
        try:
            # Only the mesh's processes take part (the step is agreed already).
            tree = checkpoint.restore_checkpoint(
                self.directory, target, step, resize=True, check_in_sync=False
            )
        except ValueError as e:
            if "['model_state']" not in str(e):
                raise
            this = "has model state" if init_model_state is not None else "has no model state"
            raise ValueError(
                f"ElasticLoop.run: checkpoint {step} in {self.directory!r} and this loop "
                f"differ in model state (this loop {this}; {e}). Build the loop as the run "
                "that saved it was built: with init_model_state= and step_options="
                '{"with_model_state": True} both, or neither; or pass another '
                "checkpoint_dir to start afresh."
            ) from e
        return as_state(tree)


def _start_writer(directory: str, step: int, leaves: list[Any], manifest: dict) -> Any:
    """Starts the process that writes checkpoint ``step``; returns ``(process, its
    staging folder)``.

    Orbax writes numpy leaves from process 0 of a ``jax.distributed`` job only, and the
    writer may be any live process: so a child process, a single-process JAX on CPU,
    writes them (asynchronously: the step goes on meanwhile) with orbax into a staging
    folder of its own, ``.lsgd-staging-<step>-<pid>`` (never a step's name), and then
    renames the finalized step folder to ``<step>``: atomic, and the first writer of a
    step wins (if two writers of one step both finish, the later rename fails and its
    copy is dropped). The child outlives a trainer that dies: the state it was given is
    a whole checkpoint of its step, and it finishes writing it.
    """
    import pickle
    import subprocess
    import sys

    staging = os.path.join(directory, f".lsgd-staging-{step}-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    with open(os.path.join(staging, "state.pkl"), "wb") as f:
        pickle.dump({"leaves": leaves, "manifest": manifest}, f, protocol=5)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    for name in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES"):
        env.pop(name, None)
    cmd = [
        sys.executable,
        "-m",
        "lsgd_jax.elastic._elastic_checkpoint",
        staging,
        directory,
        str(step),
    ]
    with open(os.path.join(staging, "writer.log"), "wb") as log:
        child = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    return child, staging


def write_staged(staging: str, directory: str, step: int) -> None:
    """The writer process's work: the staged state as checkpoint ``step`` (see
    :func:`_start_writer`), then the staging folder is removed."""
    import pickle

    with open(os.path.join(staging, "state.pkl"), "rb") as f:
        staged = pickle.load(f)
    out = os.path.join(staging, "ckpt")
    written = checkpoint.save_staged(out, step, staged["leaves"], staged["manifest"])
    try:
        os.rename(written, checkpoint.step_dir(directory, step))
    except OSError:  # another writer finalized this step first: its copy stands
        pass
    shutil.rmtree(staging, ignore_errors=True)


def _failed(directory: str, step: int, staging: str, code: int) -> RuntimeError:
    log = os.path.join(staging, "writer.log")
    text = open(log, errors="replace").read()[-2000:] if os.path.exists(log) else ""
    return RuntimeError(
        f"lsgd_jax.elastic: writing checkpoint {step} into {directory!r} failed (exit "
        f"status {code}); the writer's output ends:\n{text}"
    )


def finalized(directory: str, step: int) -> bool:
    """Whether checkpoint ``step`` is finalized under ``directory``."""
    return os.path.isdir(checkpoint.step_dir(directory, step))


if __name__ == "__main__":  # the writer process: STAGING DIRECTORY STEP
    import sys

    write_staged(sys.argv[1], sys.argv[2], int(sys.argv[3]))
