"""The static configuration a checkpoint was saved with, and what changed since.

The arrays of a checkpoint do not carry the static metadata of the post-local SGD
states (the hook's axes and switch step, the averager and its options); the target of a
restore supplies it. So that a restore can say when that configuration changed, the
manifest records it in a form that is the same in every process that built it alike:
functions (an optax outer optimizer) by name and the simple values they close over,
never by memory address. ``differences`` then gives one line per changed field.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import types
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from lsgd_jax._core import _state_protocol as sp

_ADDRESS = re.compile(r"\s+at 0x[0-9a-fA-F]+|0x[0-9a-fA-F]{6,}")
_FUNCTION_DEPTH = 8  # nested functions followed through closures (optax.chain of chains)
_ITEMS = 32  # items of one tuple, list or dict described; the rest are counted
_NODES = 2000  # values described per field at most, in all
_TEXT = 200  # characters of one string or repr


def strip_addresses(text: str) -> str:
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
    return _Describer().describe(value, _FUNCTION_DEPTH, False) or "…"


class _Describer:
    """One description's walk, with its budget of values (``_NODES``)."""

    def __init__(self) -> None:
        self.budget = _NODES

    def items(self, xs: Any, depth: int, closure: bool) -> str:
        xs = list(xs)
        parts = [self.describe(x, depth, closure) or "…" for x in xs[:_ITEMS]]
        if len(xs) > _ITEMS:
            parts.append(f"… {len(xs) - _ITEMS} more")
        return ", ".join(parts)

    def describe(self, x: Any, depth: int, closure: bool) -> str | None:
        """None: ``x`` is no simple value, and ``closure`` asks to leave it out."""
        self.budget -= 1
        if self.budget < 0:
            return "…"
        simple = _simple(x)
        if simple is not None:
            return simple
        if isinstance(x, tuple):
            fields = getattr(type(x), "_fields", None)
            if fields is not None:  # a NamedTuple, e.g. an optax GradientTransformation
                parts = (
                    f"{k}={self.describe(v, depth, closure) or '…'}" for k, v in zip(fields, x)
                )
                return f"{type(x).__qualname__}({', '.join(parts)})"
            return f"({self.items(x, depth, closure)}{',' if len(x) == 1 else ''})"
        if isinstance(x, functools.partial):
            inner = [
                self.describe(x.func, depth, closure) or "…",
                self.items(x.args, depth, closure),
            ]
            inner += [
                f"{k}={self.describe(v, depth, closure) or '…'}" for k, v in x.keywords.items()
            ]
            return f"partial({', '.join(p for p in inner if p)})"
        if isinstance(x, types.FunctionType):
            return self.function(x, depth)
        if callable(x) and hasattr(x, "__qualname__"):  # builtins, jitted functions
            return _qualname(x)
        if closure:
            return None
        return self.container(x, depth, closure)

    def function(self, x: types.FunctionType, depth: int) -> str:
        """Its name, and the simple values its closure holds."""
        name = _qualname(x)
        if depth <= 0:
            return name
        cells = []
        for var, cell in zip(x.__code__.co_freevars, x.__closure__ or ()):
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            text = self.describe(content, depth - 1, True)
            if text is not None:
                cells.append(f"{var}={text}")
        return f"{name}[{', '.join(cells)}]" if cells else name

    def container(self, x: Any, depth: int, closure: bool) -> str:
        """Arrays by shape and dtype; lists, mappings and dataclasses item by item."""
        if isinstance(x, (np.ndarray, jax.Array)):
            return f"array{list(x.shape)}:{x.dtype}"
        if isinstance(x, list):
            return f"[{self.items(x, depth, closure)}]"
        if isinstance(x, Mapping):
            pairs = [
                f"{self.describe(k, depth, closure)}: {self.describe(v, depth, closure)}"
                for k, v in x.items()
            ]
            return "{" + ", ".join(pairs[:_ITEMS]) + (", …" if len(pairs) > _ITEMS else "") + "}"
        if dataclasses.is_dataclass(x):
            parts = (
                f"{f.name}={self.describe(getattr(x, f.name), depth, closure)}"
                for f in dataclasses.fields(x)
            )
            return f"{type(x).__qualname__}({', '.join(parts)})"
        text = strip_addresses(repr(x))
        return text if len(text) <= _TEXT else text[:_TEXT] + "…"


def _simple(x: Any) -> str | None:
    """The description of a number, string, None, NumPy scalar, dtype or type; else None."""
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
        shown = repr(x)
        return shown if len(shown) <= _TEXT else shown[:_TEXT] + "…"
    if isinstance(x, np.generic):
        return repr(x.item())
    if isinstance(x, np.dtype):
        return f"dtype({x})"
    if isinstance(x, type):
        return _qualname(x)
    return None


_is_static_node = sp.is_state


def _described(name: str, value: Any, by_fields: bool) -> dict[str, str]:
    """A CONFIG field's description: its value, or (``by_fields``, a configuration
    object such as the averager) its type and each of its fields."""
    if not by_fields or value is None or not dataclasses.is_dataclass(value):
        return {name: _stable(value)}
    fields = {name: type(value).__qualname__}
    for f in dataclasses.fields(value):
        fields[f"{name}.{f.name}"] = _stable(getattr(value, f.name))
    return fields


def _config_fields(node: Any) -> dict[str, str]:
    """Every CONFIG field of a state, described (see ``sp.field``'s ``checkpoint``)."""
    fields: dict[str, str] = {}
    for f in dataclasses.fields(node):
        if f.metadata.get("role") == sp.CONFIG:
            by_fields = f.metadata.get("checkpoint") == "fields"
            fields.update(_described(f.name, getattr(node, f.name), by_fields))
    return fields


def static_config(tree: Any) -> dict[str, dict[str, Any]]:
    """``{path: {"type": ..., "fields": {field: description}}}`` for each post-local SGD state.

    The static fields of every ``PostLocalSGDState`` (its axes, ``start_localSGD_iter``,
    ``post_local_gradient_allreduce``) and of the averager of every ``ModelAveragerState``.

    Example:
      >>> import jax.numpy as jnp, optax, lsgd_jax
      >>> from lsgd_jax.checkpoint._checkpoint_config import static_config
      >>> averager = lsgd_jax.PeriodicModelAverager(2, outer_optimizer=optax.sgd(0.7))
      >>> state = lsgd_jax.model_averaging(averager).init({"w": jnp.zeros(2)})
      >>> fields = static_config(state)[""]["fields"]
      >>> fields["averager.period"], "step_size=-0.7" in fields["averager.outer_optimizer"]
      ('2', True)
    """
    config: dict[str, dict[str, Any]] = {}

    def visit(prefix: str, subtree: Any) -> None:
        flat, _ = jax.tree_util.tree_flatten_with_path(subtree, is_leaf=_is_static_node)
        for path, node in flat:
            if not _is_static_node(node):
                continue
            where = prefix + jax.tree_util.keystr(path)
            config[where] = {"type": type(node).__name__, "fields": _config_fields(node)}
            for name in sp.data_names(node):  # an outer optimizer's state may hold more
                visit(f"{where}.{name}", getattr(node, name))

    visit("", tree)
    return config


def skeleton(tree: Any) -> str:
    """The tree structure with the post-local SGD states' static fields blanked out."""

    def blank(node: Any) -> Any:
        blanks = {
            f.name: f.metadata["blank"] for f in dataclasses.fields(node) if "blank" in f.metadata
        }
        inner = {n: _blank_static(getattr(node, n), blank) for n in sp.data_names(node)}
        return node.replace(**blanks, **inner)

    return strip_addresses(str(jax.tree.structure(_blank_static(tree, blank))))


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


def differences(manifest: dict, paths: list[str], treedef: str, target: Any) -> list[str]:
    """One line per difference in names or static metadata, saved -> target (none: [])."""
    renamed = [(a, b) for a, b in zip(manifest["paths"], paths) if a != b]
    lines = [f"leaf {a or '(root)'} -> {b or '(root)'}" for a, b in renamed[:5]]
    if len(renamed) > 5:
        lines.append(f"… and {len(renamed) - 5} more renamed leaves")
    if "static" not in manifest:  # saved before lsgd_jax recorded it: the whole treedef
        saved, now = strip_addresses(manifest.get("treedef", "")), strip_addresses(treedef)
        if saved != now and not lines:
            lines.append(f"static metadata or structure: {_short_pair(saved, now)}")
        return lines
    saved_static, now_static = manifest["static"], static_config(target)
    for where in dict.fromkeys([*saved_static, *now_static]):
        a, b, name = saved_static.get(where), now_static.get(where), where or "(root)"
        if a is None or b is None or a["type"] != b["type"]:
            kinds = [x["type"] if x else "nothing" for x in (a, b)]
            lines.append(f"{name}: {kinds[0]} -> {kinds[1]}")
            continue
        for field in dict.fromkeys([*a["fields"], *b["fields"]]):
            x, y = (f.get(field, "(absent)") for f in (a["fields"], b["fields"]))
            if {x, y} == {"(absent)", "None"}:  # a field added since, at its default
                continue
            if x != y:
                lines.append(f"{name}.{field}: {_short_pair(x, y)}")
    shape = skeleton(target)
    structural = renamed or set(saved_static) != set(now_static)
    if not structural and manifest.get("skeleton", shape) != shape:
        lines.append(f"structure: {_short_pair(manifest['skeleton'], shape)}")
    return lines


def mismatch(step: int, lines: list[str], *, strict: bool) -> str:
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
