"""Which saved checkpoint steps are readable: a cheap check of their files.

After a save, process 0 writes ``lsgd_jax_files.json`` into the step folder: the size of
every file of the step. A later check compares the sizes and parses the step's small
JSON files (a listing and small reads, no array restore, no collective), so that a step
damaged after the save (a full disk, an interrupted copy) is skipped instead of failing
the resume. Nothing here deletes or rewrites a saved file.
"""

from __future__ import annotations

import json
import os
import warnings

_FILES = "lsgd_jax_files.json"  # the step's files and their sizes, written after the save
# JSON files of a step that the cheap check parses when present (orbax's and ours).
_JSON_FILES = ("_CHECKPOINT_METADATA", "manifest/metadata", "arrays/_METADATA")


class UnreadableCheckpointError(ValueError):
    """A checkpoint step cannot be read: its files are truncated, missing, or do not parse.

    Raised by :func:`restore_checkpoint` for a step asked for explicitly (``step=N``), or
    when no saved step is readable. Without ``step``, unreadable steps are skipped with a
    warning and the newest readable one is restored. Nothing is deleted.

    Attributes:
      step: the unreadable step (None: no step was readable).
      path: the damaged file, or the folder whose files failed to read.
      reason: what is wrong with it.

    Example:
      >>> import lsgd_jax
      >>> err = lsgd_jax.UnreadableCheckpointError(
      ...     "damaged", 6, "/ckpt/6/_CHECKPOINT_METADATA", "empty")
      >>> err.step, err.reason
      (6, 'empty')
    """

    def __init__(self, message: str, step: int | None, path: str, reason: str) -> None:
        super().__init__(message)
        self.step = step
        self.path = path
        self.reason = reason


def step_dir(directory: str | os.PathLike, step: int) -> str:
    return os.path.join(os.path.abspath(os.fspath(directory)), str(step))


def write_file_sizes(step_dir: str) -> None:
    """Writes ``lsgd_jax_files.json``: every file of the finished step and its size."""
    sizes = {}
    for root, _, names in os.walk(step_dir):
        for name in names:
            if name.startswith((_FILES, f".{_FILES}")):
                continue
            path = os.path.join(root, name)
            sizes[os.path.relpath(path, step_dir).replace(os.sep, "/")] = os.path.getsize(path)
    tmp = os.path.join(step_dir, f".{_FILES}.tmp")
    try:  # write, then rename: a reader sees the whole list or none
        with open(tmp, "w") as f:
            json.dump({"format": 1, "files": dict(sorted(sizes.items()))}, f)
        os.replace(tmp, os.path.join(step_dir, _FILES))
    except OSError as e:
        warnings.warn(
            f"save_checkpoint: could not write {os.path.join(step_dir, _FILES)} ({e}); the "
            "checkpoint is complete, but a later truncation of its array files will only "
            "be found when they are read.",
            stacklevel=3,
        )


def damage(step_dir: str) -> tuple[str, str] | None:
    """``(file, what is wrong)`` for a damaged step folder; None if it looks readable.

    A listing and small reads: the sizes recorded in ``lsgd_jax_files.json`` at save time
    (when there is one), then the step's small JSON files must parse.
    """
    sidecar, sidecar_damage, listed = os.path.join(step_dir, _FILES), None, None
    if os.path.exists(sidecar):
        try:
            with open(sidecar, encoding="utf-8") as f:
                listed = dict(json.load(f)["files"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            sidecar_damage = (sidecar, f"does not parse ({type(e).__name__}: {e})")
    bad = []
    for rel, size in (listed or {}).items():
        path = os.path.join(step_dir, *rel.split("/"))
        try:
            actual = os.path.getsize(path)
        except OSError:
            bad.append((path, "is missing"))
            continue
        if actual != size:
            bad.append((path, f"has {actual} bytes, {size} when saved"))
    if bad:
        more = f" (and {len(bad) - 1} more damaged files)" if len(bad) > 1 else ""
        return bad[0][0], bad[0][1] + more
    for rel in _JSON_FILES:
        path = os.path.join(step_dir, *rel.split("/"))
        if not os.path.exists(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                json.load(f)
        except (OSError, ValueError) as e:
            return path, f"does not parse as JSON ({type(e).__name__}: {e})"
    return sidecar_damage


def readable(directory: str | os.PathLike, steps: list[int]) -> list[int]:
    return [s for s in steps if damage(step_dir(directory, s)) is None]


def skipped_message(what: str, step: int, path: str, reason: str) -> str:
    return (
        f"{what}: skipping checkpoint {step}, it is unreadable: {path} {reason}. Using "
        "the next older step; nothing is deleted."
    )


class Damaged(Exception):
    """A step folder failed the cheap check or its reads: ``args == (path, reason)``."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(path, reason)
        self.path, self.reason = path, reason


def set_aside_if_damaged(directory: str | os.PathLike, step: int) -> None:
    """Moves an unreadable folder of ``step`` to ``<step>.unreadable[-k]`` before a save.

    After a resume skipped a damaged step, training reaches that step number again and
    saves it: the damaged folder would block the save. It is renamed, not deleted (and
    its new name is no step, so listings ignore it); an intact folder is left alone.
    With several processes, process 0 renames and every process waits for it.
    """
    import jax  # the process layout

    path = step_dir(directory, step)
    found = damage(path) if os.path.isdir(path) else None
    if found is not None and jax.process_index() == 0:
        aside, k = f"{path}.unreadable", 1
        while os.path.exists(aside):
            k += 1
            aside = f"{path}.unreadable-{k}"
        os.rename(path, aside)
        warnings.warn(
            f"save_checkpoint: checkpoint {step} exists but is unreadable ({found[0]} "
            f"{found[1]}); moved it to {aside} (nothing deleted) and saving step {step} anew.",
            stacklevel=3,
        )
    if found is not None and jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"lsgd_jax set aside {int(step)}")
