"""A checkpoint written in two halves: staged (flattened, with its manifest) where the
state is, then saved elsewhere (``lsgd_jax.elastic``'s writer process saves while the
training goes on). What the elastic loop uses of this room, beside
``restore_checkpoint``."""

from __future__ import annotations

import os
from typing import Any

from lsgd_jax.checkpoint import _checkpoint_files as _files
from lsgd_jax.checkpoint import _format

step_dir = _files.step_dir


def require_orbax() -> None:
    """ImportError, with the install hint, if orbax-checkpoint is missing."""
    _format.ocp()


def stage(tree: Any) -> tuple[list[Any], dict[str, Any]]:
    """``tree``'s leaves and the manifest a checkpoint of it carries."""
    paths, leaves, treedef = _format.flatten(tree)
    return leaves, _format.manifest(tree, paths, leaves, treedef)


def save_staged(folder: str, step: int, leaves: list[Any], manifest: dict[str, Any]) -> str:
    """Saves staged ``leaves`` as checkpoint ``step`` under ``folder`` (finished, with
    the file sizes a later read checks); returns the step's folder."""
    with _format.manager(folder) as manager:
        manager.save(step, args=_format.save_args(leaves, manifest), force=True)
        manager.wait_until_finished()
    written = _files.step_dir(folder, step)
    _files.write_file_sizes(written)
    return written


def latest_readable_step(directory: str | os.PathLike) -> int | None:
    """The newest finalized and undamaged step under ``directory``, or None: only
    folders named by a step alone count (orbax's finalized ones), never a save in
    progress (``<k>.orbax-checkpoint-tmp``) or a set-aside step (``<k>.unreadable``).

    Example:
      >>> import tempfile
      >>> from lsgd_jax.checkpoint import latest_readable_step
      >>> with tempfile.TemporaryDirectory() as d:
      ...     os.makedirs(os.path.join(d, "4.orbax-checkpoint-tmp"))
      ...     print(latest_readable_step(d))
      None
    """
    if not os.path.isdir(directory):
        return None
    names = {n for n in os.listdir(directory) if n.isdigit()}
    for step in reversed(_format.steps(directory)):
        if str(step) in names and _files.damage(_files.step_dir(directory, step)) is None:
            return step
    return None
