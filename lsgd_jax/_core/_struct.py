"""One idiom for every state type: an immutable dataclass registered as a pytree.

Fields marked with :func:`static_field` are static metadata (part of the tree structure,
hashable: axis names, the averager, a pinned phase); the others are children (arrays or
subtrees), with their field names as keys (``state.iter``, ``state.step``), so paths in
errors and checkpoints read like attribute access. Unflattening and :meth:`Struct.replace`
bypass ``__init__``: validation and logging run once, where the user builds the value,
never when JAX rebuilds it (flax ``struct.py``'s idiom, with JAX alone).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, cast

import jax

T = TypeVar("T", bound="Struct")


def static_field(**kwargs: Any) -> Any:
    """A dataclass field that is static pytree metadata (not a child).

    Example:
      >>> import dataclasses
      >>> from lsgd_jax._core._struct import Struct, pytree_dataclass, static_field
      >>> @pytree_dataclass
      ... @dataclasses.dataclass(frozen=True, eq=False)
      ... class Counter(Struct):
      ...     count: int
      ...     name: str = static_field(default="c")
      >>> import jax
      >>> jax.tree.leaves(Counter(3))
      [3]
    """
    metadata = dict(kwargs.pop("metadata", {}) or {}, static=True)
    return dataclasses.field(metadata=metadata, **kwargs)


class Struct:
    """Base of the state types: immutable, and ``replace`` without re-running ``__init__``.

    Subclasses are dataclasses declared ``frozen=True, eq=False`` (identity, as arrays
    have no boolean equality); their error on assignment says how to make a changed copy.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"{type(self).__name__} is immutable; use state.replace({name}=...) for a new one."
        )

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable.")

    def replace(self: T, **changes: Any) -> T:
        """A copy with the given fields replaced (no validation, no logging).

        Args:
          **changes: new values by field name.

        Returns:
          A new instance of the same type.

        Example:
          >>> import jax.numpy as jnp, lsgd_jax
          >>> s = lsgd_jax.PostLocalSGDState(None, None, 4).replace(iter=jnp.int32(3))
          >>> int(s.iter)
          3
        """
        names = [f.name for f in dataclasses.fields(self)]  # type: ignore[arg-type]
        unknown = set(changes) - set(names)
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field(s) {sorted(unknown)}.")
        obj = object.__new__(type(self))
        for name in names:
            object.__setattr__(obj, name, changes.get(name, getattr(self, name)))
        return obj


def pytree_dataclass(cls: type[T] | None = None, *, omit_if_none: str | None = None) -> Any:
    """Registers the frozen dataclass ``cls`` (a :class:`Struct`) as a pytree with keys.

    A child field whose metadata says ``"omit_if_none": True`` (``sp.field(...,
    added=True)``: a field added to a state after checkpoints of it were saved) is left
    out of the children while it is None, so the tree structure is what it was before
    the field existed and a saved checkpoint's structure still matches; while present,
    the aux data names it.

    Args:
      cls: the class (or None, to use ``@pytree_dataclass(omit_if_none=...)``).
      omit_if_none: the first such field, by name (the count of children says whether
        it is there; kept for the structures saved with it).

    Returns:
      ``cls``, registered (or a decorator that registers it).
    """
    if cls is None:
        return lambda c: pytree_dataclass(c, omit_if_none=omit_if_none)
    fields = dataclasses.fields(cast(Any, cls))  # a dataclass, by this module's contract
    meta = tuple(f.name for f in fields if f.metadata.get("static"))
    data = tuple(f.name for f in fields if not f.metadata.get("static"))
    if omit_if_none is not None and omit_if_none not in data:
        raise ValueError(f"omit_if_none={omit_if_none!r} is not a child field of {cls}")
    keys = {n: jax.tree_util.GetAttrKey(n) for n in data}
    added = tuple(f.name for f in fields if f.metadata.get("omit_if_none"))
    kept = tuple(n for n in data if n != omit_if_none and n not in added)

    def present(x: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The children's names, and the added fields present (named in the aux data)."""
        first = () if omit_if_none is None or getattr(x, omit_if_none) is None else (omit_if_none,)
        more = tuple(n for n in added if getattr(x, n) is not None)
        return tuple(n for n in data if n in kept or n in first or n in more), more

    def aux_of(x: Any, more: tuple[str, ...]) -> tuple[Any, ...]:
        statics = tuple(getattr(x, n) for n in meta)
        return (*statics, ("added", more)) if more else statics

    def flatten_with_keys(x: Any) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
        names, more = present(x)
        return [(keys[n], getattr(x, n)) for n in names], aux_of(x, more)

    def flatten(x: Any) -> tuple[list[Any], tuple[Any, ...]]:
        names, more = present(x)
        return [getattr(x, n) for n in names], aux_of(x, more)

    def unflatten(aux: tuple[Any, ...], children: Any) -> Any:
        children = list(children)
        more = aux[len(meta)][1] if len(aux) > len(meta) else ()
        known = len(kept) + len(more)
        first = (omit_if_none,) if omit_if_none is not None and len(children) > known else ()
        names = [n for n in data if n in kept or n in first or n in more]
        obj = object.__new__(cls)
        for n, v in zip(meta, aux):
            object.__setattr__(obj, n, v)
        for n in ((omit_if_none,) if omit_if_none else ()) + added:  # None until given
            object.__setattr__(obj, n, None)
        for n, v in zip(names, children):
            object.__setattr__(obj, n, v)
        return obj

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    # A frozen dataclass's own guard says "cannot assign to field"; say how to change it.
    cls.__setattr__ = Struct.__setattr__  # type: ignore[method-assign]
    cls.__delattr__ = Struct.__delattr__  # type: ignore[method-assign]
    return cls
