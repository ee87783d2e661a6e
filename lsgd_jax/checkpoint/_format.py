"""The checkpoint format, written in one place for the plain and the elastic writers.

A checkpoint step is an orbax ``CheckpointManager`` step with two items: ``arrays``
(the tree's array leaves, named ``leaf_00000``, ... in flatten order) and ``manifest``
(JSON: each leaf's path, shape and dtype, the tree structure, and the static
configuration of the post-local SGD states with the structure they were saved in, which
a restore compares with its target's: ``_checkpoint_config``). ``save_checkpoint``
writes it from every process; the elastic loop's writer, from a child process of the
lowest live process, from gathered leaves. Both build it here.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from lsgd_jax.checkpoint import _checkpoint_config as _config

ARRAYS, MANIFEST = "arrays", "manifest"
ITEMS = (ARRAYS, MANIFEST)


def ocp() -> Any:
    """``orbax.checkpoint``, or ImportError with the install hint."""
    try:
        import orbax.checkpoint as orbax
    except ImportError as e:  # pragma: no cover - exercised only without orbax
        raise ImportError(
            "lsgd_jax checkpoints need orbax-checkpoint: pip install 'lsgd_jax[checkpoint]'."
        ) from e
    return orbax


def manager(directory: str | os.PathLike, max_to_keep: int | None = None) -> Any:
    """The blocking orbax manager of a checkpoint folder (created if missing; creating
    it is a barrier, so with several processes every process must open it)."""
    orbax = ocp()
    options = orbax.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False
    )
    return orbax.CheckpointManager(
        os.path.abspath(os.fspath(directory)), options=options, item_names=ITEMS
    )


def steps(directory: str | os.PathLike) -> list[int]:
    """The complete checkpoints' steps: a listing, no collective (any process may ask)."""
    if not os.path.isdir(directory):
        return []
    return sorted(ocp().utils.checkpoint_steps(os.path.abspath(os.fspath(directory))))


def flatten(tree: Any) -> tuple[list[str], list[Any], Any]:
    """``(paths, leaves, treedef)`` of ``tree``, paths as ``jax.tree_util.keystr``."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    return paths, [x for _, x in flat], treedef


def leaf_names(n: int) -> list[str]:
    """The names of ``n`` leaves in the ``arrays`` item."""
    return [f"leaf_{i:05d}" for i in range(n)]


def manifest(tree: Any, paths: list[str], leaves: list[Any], treedef: Any) -> dict[str, Any]:
    """The ``manifest`` item of ``tree`` (flattened to ``paths``, ``leaves``, ``treedef``).

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax.checkpoint import _format
      >>> tree = {"w": jnp.zeros((2, 3))}
      >>> m = _format.manifest(tree, *_format.flatten(tree))
      >>> m["paths"], m["shapes"], m["dtypes"]
      (["['w']"], [[2, 3]], ['float32'])
    """
    return {
        "paths": paths,
        "shapes": [list(np.shape(x)) for x in leaves],
        "dtypes": [str(np.dtype(x.dtype)) for x in leaves],
        "treedef": str(treedef),  # what older versions compare
        "static": _config.static_config(tree),
        "skeleton": _config.skeleton(tree),
    }


def save_args(leaves: list[Any], manifest: dict[str, Any]) -> Any:
    """The orbax arguments that save one step of this format."""
    orbax = ocp()
    return orbax.args.Composite(
        **{
            ARRAYS: orbax.args.StandardSave(dict(zip(leaf_names(len(leaves)), leaves))),
            MANIFEST: orbax.args.JsonSave(manifest),
        }
    )
