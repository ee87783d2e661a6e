"""Fragments: the slices of the params that a streaming average sends one at a time.

With ``fragments=K`` (Streaming DiLoCo), the floating values of the params, flattened in
tree order, are cut into K equal slices; each average sends one. A :class:`_Cut` holds
the static slices of one fragment for one params tree, and takes or puts them in that
tree and in trees that hold params-shaped parts (an optimizer state's momentum), so that
element i of a moment is averaged on the step its param element i is. A part with some
of the params' leaves left out (None, as ``post_local_sgd_optimizer(average_opt_state=
<mask>)`` leaves an unchosen leaf, or optax's ``MaskedNode``) is cut the same way, leaf
by leaf where it holds one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lsgd_jax._core import _collectives
from lsgd_jax._core._errors import ModelShapeError


@dataclasses.dataclass(frozen=True)
class Fragment:
    """The k-th of K equal slices of the params' floating values, in flattened order.

    ``cut(params)`` fixes the slices for one params tree: a leaf may be cut between two
    fragments.
    """

    k: int
    count: int

    def cut(self, params: Any) -> Cut:
        """The ``(leaf index, lo, hi)`` slices of ``params``'s raveled leaves in this
        fragment, as a :class:`Cut`.

        Example:
          >>> import jax.numpy as jnp
          >>> from lsgd_jax.averaging._fragments import Fragment
          >>> Fragment(1, 2).cut({"a": jnp.zeros(3), "b": jnp.zeros(1)}).pieces
          ((0, 2, 3), (1, 0, 1))
        """
        leaves = jax.tree.leaves(params)
        sizes = [
            (i, int(np.prod(jnp.shape(x))))
            for i, x in enumerate(leaves)
            if _collectives.is_averaged(x)
        ]
        total = sum(n for _, n in sizes)
        if total and total < self.count:
            raise ModelShapeError(
                f"fragments={self.count} needs at least that many floating values to split, "
                f"got {total}; use fewer fragments."
            )
        chunk = -(-total // self.count)
        start, end = self.k * chunk, min((self.k + 1) * chunk, total)
        pieces, offset = [], 0
        for i, n in sizes:
            lo, hi = max(start, offset), min(end, offset + n)
            if lo < hi:
                pieces.append((i, lo - offset, hi - offset))
            offset += n
        return Cut(tuple(pieces), jax.tree.structure(params), _shapes(params))


def _shapes(tree: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(jnp.shape(x) for x in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class Cut:
    """Static slices of a params-shaped tree: what one fragment averages.

    ``take`` returns the flat pieces, ``put`` writes new values into exactly those
    positions (static slices: the other elements are untouched). ``take_aligned`` /
    ``put_aligned`` do the same inside a tree that holds params-shaped parts (an
    optimizer state's momentum, Adam's moments): those parts are cut like the params,
    so element i of a moment is averaged on the step its param element i is; any other
    leaf is taken whole.
    """

    pieces: tuple[tuple[int, int, int], ...]
    treedef: Any
    shapes: tuple[tuple[int, ...], ...]

    def take(self, tree: Any) -> list[Any]:
        leaves = jax.tree.leaves(tree)
        return [jnp.ravel(leaves[i])[lo:hi] for i, lo, hi in self.pieces]

    def put(self, tree: Any, values: list[Any]) -> Any:
        leaves, treedef = jax.tree.flatten(tree)
        return jax.tree.unflatten(treedef, _put_leaves(leaves, self.pieces, values))

    def _layout(self, node: Any) -> tuple[list[Any], Any, tuple[bool, ...]] | None:
        """``(leaves, treedef, held)`` when ``node`` is shaped like the params, some of
        their leaves possibly left out (None or ``optax.MaskedNode``): its leaves line up
        with the params' (``held[i]``: leaf i is there, with the param's shape). None
        when it is not such a part, or holds none of the params' leaves."""
        if jax.tree.structure(node) == self.treedef:  # every leaf there
            leaves, treedef = jax.tree.flatten(node)
            held = (True,) * len(leaves)
        else:
            leaves, treedef = jax.tree.flatten(node, is_leaf=_left_out)
            if len(leaves) != len(self.shapes) or not any(_left_out(x) for x in leaves):
                return None
            gaps = [0 if _left_out(x) else x for x in leaves]  # a leaf where one is left out
            if jax.tree.structure(jax.tree.unflatten(treedef, gaps)) != self.treedef:
                return None
            held = tuple(not _left_out(x) for x in leaves)
        if not any(held):
            return None
        if any(h and jnp.shape(x) != s for h, x, s in zip(held, leaves, self.shapes)):
            return None
        return leaves, treedef, held

    def _is_part(self, node: Any) -> bool:
        return self._layout(node) is not None

    def take_aligned(self, tree: Any, params: Any) -> Any:
        del params  # the cut already holds the params' layout
        if tree is None:
            return None
        nodes = jax.tree.leaves(tree, is_leaf=self._is_part)
        out = []
        for node in nodes:
            layout = self._layout(node)
            if layout is None:
                out.append(node)
                continue
            leaves, _, held = layout
            out.append([jnp.ravel(leaves[i])[lo:hi] for i, lo, hi in self.pieces if held[i]])
        return out

    def put_aligned(self, tree: Any, params: Any, values: Any) -> Any:
        del params
        if tree is None:
            return None
        nodes, treedef = jax.tree.flatten(tree, is_leaf=self._is_part)
        new = []
        for node, value in zip(nodes, values):
            layout = self._layout(node)
            if layout is None:
                new.append(value)
                continue
            leaves, node_def, held = layout
            pieces = [piece for piece in self.pieces if held[piece[0]]]
            new.append(jax.tree.unflatten(node_def, _put_leaves(leaves, pieces, value)))
        return jax.tree.unflatten(treedef, new)


def _left_out(x: Any) -> bool:
    """A leaf of the params that a params-shaped part does not hold."""
    return x is None or isinstance(x, optax.MaskedNode)


def _put_leaves(leaves: list[Any], pieces: Any, values: list[Any]) -> list[Any]:
    """``leaves`` with ``values`` written into the ``(leaf, lo, hi)`` slices ``pieces``."""
    leaves = list(leaves)
    for (i, lo, hi), v in zip(pieces, values):
        x = leaves[i]
        flat = jnp.ravel(x).at[lo:hi].set(v.astype(x.dtype))
        leaves[i] = _collectives.cast_varying(flat.reshape(x.shape), _collectives.vma(x))
    return leaves


class Whole:
    """The cut of an average without fragments: everything, as it is."""

    def take(self, tree: Any) -> Any:
        return tree

    def put(self, tree: Any, values: Any) -> Any:
        del tree
        return values

    def take_aligned(self, tree: Any, params: Any) -> Any:
        del params
        return tree

    def put_aligned(self, tree: Any, params: Any, values: Any) -> Any:
        del tree, params
        return values


WHOLE = Whole()
