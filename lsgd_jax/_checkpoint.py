"""Checkpoints of a whole training state with orbax-checkpoint, one step per folder.

The state (per-replica params, optimizer states with their ``PostLocalSGDState`` and
``ModelAveragerState``, step counters) is saved as its list of array leaves plus a small
JSON manifest of their paths, shapes and dtypes. Restoring needs a *target* tree of the
same structure (e.g. ``replicate(tx.init(params), mesh)``): it supplies the static
metadata the arrays do not carry (the axis names in ``PostLocalSGDState``, the averager
in ``ModelAveragerState``) and the shardings to restore onto, so each process reads only
its own shards.

Each step folder also holds ``lsgd_jax_files.json``, the size of every file of the step
when the save completed: a cheap check (a listing and small reads) that finds truncated
or missing files, so that a damaged newest step is skipped instead of failing the resume.
The manifest also records the static configuration of the post-local SGD states (the
hook's axes, the averager's fields) in a form that is stable across processes, so that
restoring warns only when that configuration really changed, one line per changed field.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import types
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from lsgd_jax._averaging import ModelAveragerState
from lsgd_jax._state import _META as _HOOK_FIELDS
from lsgd_jax._state import PostLocalSGDState
from lsgd_jax._sync import assert_replicas_in_sync

_ARRAYS, _MANIFEST = "arrays", "manifest"
_FILES = "lsgd_jax_files.json"  # the step's files and their sizes, written after the save
# JSON files of a step that the cheap check parses when present (orbax's and ours).
_JSON_FILES = ("_CHECKPOINT_METADATA", f"{_MANIFEST}/metadata", f"{_ARRAYS}/_METADATA")


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
      >>> from lsgd_jax._checkpoint import UnreadableCheckpointError
      >>> err = UnreadableCheckpointError("damaged", 6, "/ckpt/6/_CHECKPOINT_METADATA", "empty")
      >>> err.step, err.reason
      (6, 'empty')
    """

    def __init__(self, message: str, step: int | None, path: str, reason: str) -> None:
        super().__init__(message)
        self.step = step
        self.path = path
        self.reason = reason


def _ocp():
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover - exercised only without orbax
        raise ImportError(
            "lsgd_jax checkpoints need orbax-checkpoint: pip install 'lsgd_jax[checkpoint]'."
        ) from e
    return ocp


def _manager(directory: str | os.PathLike, max_to_keep: int | None = None):
    ocp = _ocp()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        create=True,  # creating the folder is a barrier: every process saves
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


# -- the static configuration, described the same way in every process ----------------

_ADDRESS = re.compile(r"\s+at 0x[0-9a-fA-F]+|0x[0-9a-fA-F]{6,}")
_FUNCTION_DEPTH = 8  # nested functions followed through closures (optax.chain of chains)
_ITEMS = 32  # items of one tuple, list or dict described; the rest are counted
_NODES = 2000  # values described per field at most, in all
_TEXT = 200  # characters of one string or repr


def _strip_addresses(text: str) -> str:
    """``text`` without memory addresses (``<function f at 0x7f...>`` -> ``<function f>``)."""
    return _ADDRESS.sub("", text)


def _qualname(obj: Any) -> str:
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    name = name or type(obj).__qualname__
    module = getattr(obj, "__module__", None)
    return f"{module}.{name}" if module else name


def _stable(value: Any) -> str:
    """A description of a static value that is equal in every process that built it alike.

    Functions are described by module and qualified name and by the simple values in
    their closures (numbers, strings, bools, None, dtypes, tuples, nested functions), so
    that ``optax.sgd(0.7)`` and ``optax.sgd(0.5)`` differ while two ``optax.sgd(0.7)``
    agree; memory addresses never appear; arrays are described by shape and dtype only.
    """
    budget = [_NODES]

    def items(xs: Any, depth: int, closure: bool) -> str:
        xs = list(xs)
        parts = [describe(x, depth, closure) or "…" for x in xs[:_ITEMS]]
        if len(xs) > _ITEMS:
            parts.append(f"… {len(xs) - _ITEMS} more")
        return ", ".join(parts)

    def describe(x: Any, depth: int, closure: bool) -> str | None:
        """None: ``x`` is no simple value, and ``closure`` asks to leave it out."""
        budget[0] -= 1
        if budget[0] < 0:
            return "…"
        if x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
            text = repr(x)
            return text if len(text) <= _TEXT else text[:_TEXT] + "…"
        if isinstance(x, np.generic):
            return repr(x.item())
        if isinstance(x, np.dtype):
            return f"dtype({x})"
        if isinstance(x, type):
            return _qualname(x)
        if isinstance(x, tuple):
            fields = getattr(type(x), "_fields", None)
            if fields is not None:  # a NamedTuple, e.g. an optax GradientTransformation
                parts = (f"{k}={describe(v, depth, closure) or '…'}" for k, v in zip(fields, x))
                return f"{type(x).__qualname__}({', '.join(parts)})"
            return f"({items(x, depth, closure)}{',' if len(x) == 1 else ''})"
        if isinstance(x, functools.partial):
            inner = [describe(x.func, depth, closure) or "…", items(x.args, depth, closure)]
            inner += [f"{k}={describe(v, depth, closure) or '…'}" for k, v in x.keywords.items()]
            return f"partial({', '.join(p for p in inner if p)})"
        if isinstance(x, types.FunctionType):
            name = _qualname(x)
            if depth <= 0:
                return name
            cells = []
            for var, cell in zip(x.__code__.co_freevars, x.__closure__ or ()):
                try:
                    content = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                text = describe(content, depth - 1, True)
                if text is not None:
                    cells.append(f"{var}={text}")
            return f"{name}[{', '.join(cells)}]" if cells else name
        if callable(x) and hasattr(x, "__qualname__"):  # builtins, jitted functions
            return _qualname(x)
        if closure:
            return None
        if isinstance(x, (np.ndarray, jax.Array)):
            return f"array{list(x.shape)}:{x.dtype}"
        if isinstance(x, list):
            return f"[{items(x, depth, closure)}]"
        if isinstance(x, Mapping):
            pairs = [
                f"{describe(k, depth, closure)}: {describe(v, depth, closure)}"
                for k, v in x.items()
            ]
            return "{" + ", ".join(pairs[:_ITEMS]) + (", …" if len(pairs) > _ITEMS else "") + "}"
        if dataclasses.is_dataclass(x):
            parts = (
                f"{f.name}={describe(getattr(x, f.name), depth, closure)}"
                for f in dataclasses.fields(x)
            )
            return f"{type(x).__qualname__}({', '.join(parts)})"
        text = _strip_addresses(repr(x))
        return text if len(text) <= _TEXT else text[:_TEXT] + "…"

    return describe(value, _FUNCTION_DEPTH, False) or "…"


def _is_static_node(x: Any) -> bool:
    return isinstance(x, (PostLocalSGDState, ModelAveragerState))


_AVERAGER_DATA = tuple(
    f.name for f in dataclasses.fields(ModelAveragerState) if f.name != "averager"
)


def _averager_fields(averager: Any) -> dict[str, str]:
    if averager is None or not dataclasses.is_dataclass(averager):
        return {"averager": _stable(averager)}
    fields = {"averager": type(averager).__qualname__}
    for f in dataclasses.fields(averager):
        fields[f"averager.{f.name}"] = _stable(getattr(averager, f.name))
    return fields


def _static_config(tree: Any) -> dict[str, dict[str, Any]]:
    """``{path: {"type": ..., "fields": {field: description}}}`` for each post-local SGD state.

    The static fields of every ``PostLocalSGDState`` (its axes, ``start_localSGD_iter``,
    ``post_local_gradient_allreduce``) and of the averager of every ``ModelAveragerState``.
    """
    config: dict[str, dict[str, Any]] = {}

    def visit(prefix: str, subtree: Any) -> None:
        flat, _ = jax.tree_util.tree_flatten_with_path(subtree, is_leaf=_is_static_node)
        for path, node in flat:
            if not _is_static_node(node):
                continue
            where = prefix + jax.tree_util.keystr(path)
            if isinstance(node, PostLocalSGDState):
                fields = {n: _stable(getattr(node, n)) for n in _HOOK_FIELDS}
            else:
                fields = _averager_fields(node.averager)
            config[where] = {"type": type(node).__name__, "fields": fields}
            if isinstance(node, ModelAveragerState):
                for name in _AVERAGER_DATA:  # an outer optimizer's state may hold more
                    visit(f"{where}.{name}", getattr(node, name))

    visit("", tree)
    return config


def _skeleton(tree: Any) -> str:
    """The tree structure with the post-local SGD states' static fields blanked out."""

    def blank(node: Any) -> Any:
        if isinstance(node, PostLocalSGDState):
            return node.replace(
                process_group=None,
                subgroup=None,
                start_localSGD_iter=0,
                post_local_gradient_allreduce=True,
            )
        inner = {n: _blank_static(getattr(node, n), blank) for n in _AVERAGER_DATA}
        return node.replace(averager=None, **inner)

    return _strip_addresses(str(jax.tree.structure(_blank_static(tree, blank))))


def _blank_static(tree: Any, blank: Any) -> Any:
    return jax.tree.map(
        lambda x: blank(x) if _is_static_node(x) else x, tree, is_leaf=_is_static_node
    )


def _short_pair(saved: str, target: str, context: int = 30, width: int = 120) -> str:
    """``saved -> target``, cut to the part that differs when the two are long."""
    if len(saved) <= width // 2 and len(target) <= width // 2:
        return f"{saved} -> {target}"
    prefix = len(os.path.commonprefix([saved, target]))
    room = min(len(saved), len(target)) - prefix
    suffix = len(os.path.commonprefix([saved[::-1], target[::-1]]))
    suffix = min(suffix, room)

    # Start at the token holding the first difference (after a space, comma or bracket).
    start = max(saved.rfind(c, 0, prefix) for c in " ,(") + 1
    start = start if prefix - start <= 3 * context else prefix - context

    def cut(text: str) -> str:
        lo, hi = start, min(len(text), len(text) - suffix + context)
        middle = text[lo:hi]
        if len(middle) > width:
            middle = middle[:width] + "…"
        return ("…" if lo else "") + middle + ("…" if hi < len(text) else "")

    return f"{cut(saved)} -> {cut(target)}"


def _differences(manifest: dict, paths: list[str], treedef: str, target: Any) -> list[str]:
    """One line per difference in names or static metadata, saved -> target (none: [])."""
    renamed = [(a, b) for a, b in zip(manifest["paths"], paths) if a != b]
    lines = [f"leaf {a or '(root)'} -> {b or '(root)'}" for a, b in renamed[:5]]
    if len(renamed) > 5:
        lines.append(f"… and {len(renamed) - 5} more renamed leaves")
    if "static" not in manifest:  # saved before lsgd_jax recorded it: the whole treedef
        saved, now = _strip_addresses(manifest.get("treedef", "")), _strip_addresses(treedef)
        if saved != now and not lines:
            lines.append(f"static metadata or structure: {_short_pair(saved, now)}")
        return lines
    saved, now = manifest["static"], _static_config(target)
    for where in dict.fromkeys([*saved, *now]):
        a, b, name = saved.get(where), now.get(where), where or "(root)"
        if a is None or b is None or a["type"] != b["type"]:
            kinds = [x["type"] if x else "nothing" for x in (a, b)]
            lines.append(f"{name}: {kinds[0]} -> {kinds[1]}")
            continue
        for field in dict.fromkeys([*a["fields"], *b["fields"]]):
            x, y = (f.get(field, "(absent)") for f in (a["fields"], b["fields"]))
            if x != y:
                lines.append(f"{name}.{field}: {_short_pair(x, y)}")
    skeleton = _skeleton(target)
    structural = renamed or set(saved) != set(now)
    if not structural and manifest.get("skeleton", skeleton) != skeleton:
        lines.append(f"structure: {_short_pair(manifest['skeleton'], skeleton)}")
    return lines


# -- readable steps: a cheap check of the files -----------------------------------------


def _step_dir(directory: str | os.PathLike, step: int) -> str:
    return os.path.join(os.path.abspath(os.fspath(directory)), str(step))


def _write_file_sizes(step_dir: str) -> None:
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


def _damage(step_dir: str) -> tuple[str, str] | None:
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


def _readable(directory: str | os.PathLike, steps: list[int]) -> list[int]:
    return [s for s in steps if _damage(_step_dir(directory, s)) is None]


def _skipped(what: str, step: int, path: str, reason: str) -> str:
    return (
        f"{what}: skipping checkpoint {step}, it is unreadable: {path} {reason}. Using "
        "the next older step; nothing is deleted."
    )


class _Damaged(Exception):
    """A step folder failed the cheap check or its reads: ``args == (path, reason)``."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(path, reason)
        self.path, self.reason = path, reason


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
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"save_checkpoint: step must be a non-negative int, got {step!r}.")
    ocp = _ocp()
    paths, leaves, treedef = _flatten(tree)
    leaves = [_as_array(p, x) for p, x in zip(paths, leaves)]
    manifest = {
        "paths": paths,
        "shapes": [list(np.shape(x)) for x in leaves],
        "dtypes": [str(np.dtype(x.dtype)) for x in leaves],
        "treedef": str(treedef),  # what older versions compare
        "static": _static_config(tree),
        "skeleton": _skeleton(tree),
    }
    with _manager(directory, max_to_keep) as manager:
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
        step_dir = os.fspath(manager.directory / str(int(step)))
    if jax.process_index() == 0:  # the step folder is final: every process wrote its files
        _write_file_sizes(step_dir)
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
    for step in reversed(_steps(directory)):
        damage = _damage(_step_dir(directory, step))
        if damage is None:
            return step
        warnings.warn(_skipped("latest_checkpoint_step", step, *damage), stacklevel=2)
    return None


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
    strict: bool = False,
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

    When the static configuration differs from the saved one (another averager period,
    another outer optimizer learning rate, renamed leaves) the target's is used, with one
    warning that has a line per differing field, e.g. ``['opt_state'][2].averager.period:
    2 -> 3``; ``strict=True`` raises instead. Functions (e.g. an optax outer optimizer)
    compare by name and the simple values they close over, never by memory address.

    A step whose files were damaged after the save (truncated, missing, JSON that does
    not parse) is skipped with a warning naming the file, and the next older step is
    restored; so is a step whose arrays then fail to read. A damaged ``step`` asked for
    explicitly raises :class:`UnreadableCheckpointError`. Nothing is ever deleted.

    With several processes every process must call this. Afterwards
    :func:`assert_replicas_in_sync` checks that every replica and process restored the
    same step counters (unless ``check_in_sync=False``), so that a process that restored
    another step fails here instead of hanging in the first collective.

    Args:
      directory: the folder given to :func:`save_checkpoint`.
      target: a pytree like the saved one (arrays, ShapeDtypeStructs with shardings,
        or Python scalars).
      step: the step to restore; None: the newest readable one (see
        :func:`latest_checkpoint_step`).
      check_in_sync: run :func:`assert_replicas_in_sync` on the result.
      strict: raise instead of warning when names or static metadata differ.

    Returns:
      The restored pytree, with ``target``'s structure and shardings.

    Raises:
      FileNotFoundError: no checkpoint (or not ``step``) under ``directory``.
      UnreadableCheckpointError: ``step`` (or, with ``step=None``, every saved step) has
        damaged files; a subclass of ValueError.
      ValueError: the saved leaves do not match ``target``'s paths, shapes or dtypes;
        or, with ``strict=True``, its names or static metadata.
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
      ...     restored = lsgd_jax.restore_checkpoint(ckpt_dir, fresh(), strict=True)
      >>> restored["params"][0], restored["opt_state"][0].start_localSGD_iter
      (Array([1., 1., 1.], dtype=float32), 4)
    """
    ocp = _ocp()
    paths, leaves, treedef = _flatten(target)
    abstract = [_abstract(p, x) for p, x in zip(paths, leaves)]
    steps = _steps(directory)
    if step is None and not steps:
        raise FileNotFoundError(f"restore_checkpoint: no complete checkpoint under {directory!r}.")
    if step is not None and step not in steps:
        raise FileNotFoundError(
            f"restore_checkpoint: no checkpoint of step {step} under {directory!r}; "
            f"saved steps: {steps}."
        )
    skipped: list[tuple[int, _Damaged]] = []
    # A Checkpointer reads one step folder; a CheckpointManager would first read the
    # metadata of every step, and log an error for each damaged one.
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as reader:
        for candidate in [step] if step is not None else steps[::-1]:
            try:
                restored, lines = _restore_step(
                    reader, directory, candidate, paths, abstract, str(treedef), target, strict
                )
                break
            except _Damaged as d:
                if step is not None:
                    others = _readable(directory, [s for s in steps if s != step])
                    raise UnreadableCheckpointError(
                        f"restore_checkpoint: checkpoint {step} under {directory!r} is "
                        f"unreadable: {d.path} {d.reason}. Files damaged after the save (a "
                        "full disk, an interrupted copy) do this; nothing was changed. Restore "
                        f"another step (readable: {others or 'none'}; step=None takes the "
                        "newest readable one), or put back an intact copy of the folder.",
                        step,
                        d.path,
                        d.reason,
                    ) from d.__cause__
                warnings.warn(_skipped("restore_checkpoint", candidate, *d.args), stacklevel=2)
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
        warnings.warn(_mismatch(candidate, lines, strict=False), stacklevel=2)
    names = _leaf_names(len(abstract))
    tree = jax.tree_util.tree_unflatten(treedef, [restored[n] for n in names])
    if check_in_sync:
        assert_replicas_in_sync(tree)
    return tree


def _restore_step(
    reader: Any,
    directory: str | os.PathLike,
    step: int,
    paths: list[str],
    abstract: list[Any],
    treedef: str,
    target: Any,
    strict: bool,
) -> tuple[dict[str, Any], list[str]]:
    """The arrays of ``step`` and the differences to report; raises _Damaged if unreadable."""
    ocp = _ocp()
    step_dir = _step_dir(directory, step)
    damage = _damage(step_dir)
    if damage is not None:
        raise _Damaged(*damage)
    try:
        manifest = reader.restore(
            step_dir, args=ocp.args.Composite(**{_MANIFEST: ocp.args.JsonRestore()})
        )[_MANIFEST]
    except Exception as e:
        raise _Damaged(
            os.path.join(step_dir, _MANIFEST), f"failed to read ({type(e).__name__}: {e})"
        ) from e
    _check_manifest(manifest, paths, abstract, step)
    lines = _differences(manifest, paths, treedef, target)
    if lines and strict:
        raise ValueError(_mismatch(step, lines, strict=True))
    names = _leaf_names(len(abstract))
    try:
        restored = reader.restore(
            step_dir,
            args=ocp.args.Composite(
                **{_ARRAYS: ocp.args.StandardRestore(dict(zip(names, abstract)))}
            ),
        )[_ARRAYS]
    except Exception as e:
        message = str(e) if len(str(e)) <= 300 else str(e)[:300] + "…"
        raise _Damaged(
            os.path.join(step_dir, _ARRAYS), f"failed to read ({type(e).__name__}: {message})"
        ) from e
    return restored, lines


def _mismatch(step: int, lines: list[str], *, strict: bool) -> str:
    body = "".join(f"\n  {line}" for line in lines)
    if strict:
        return (
            f"restore_checkpoint: the target differs from checkpoint {step} in names or "
            f"static metadata (saved -> target):{body}\nBuild the target as the saved tree "
            "was built, or pass strict=False to restore with the target's metadata."
        )
    return (
        f"restore_checkpoint: the target differs from checkpoint {step} in names or static "
        f"metadata only; the target's are used (saved -> target):{body}"
    )


def _check_manifest(manifest: dict, paths: list[str], abstract: list[Any], step: int) -> None:
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
