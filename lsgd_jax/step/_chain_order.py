"""The order of an optimizer chain, read from its state: the hook first, the averaging last.

``optax.chain`` keeps one state per transformation, in order, as a plain tuple;
``optax.named_chain`` as an OrderedDict. Wrappers (``MultiSteps``,
``inject_hyperparams``, ``apply_if_finite``, ``masked``, ``post_local_sgd_optimizer``...)
keep the wrapped chain's state in a field of a state type of their own. So the path from
the root of an optimizer state to the hook's :class:`PostLocalSGDState` says what comes
before it: at every chain on the way, the element holding the hook must be the first.
Likewise every chain on the way to a ``ModelAveragerState`` must end with it. A stateless
transformation still has its place in its chain (``optax.EmptyState()``), so a clip or a
scale before the hook shows as well.

A partition (``optax.partition``: a plain dict in its state's ``inner_states``) runs its
chains side by side, not one after another: each is checked on its own, as is any state
of a wrapper of one's own (a dict, or a tuple that holds a bare array such as a count).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from lsgd_jax._core import _compat
from lsgd_jax._core import _state_protocol as sp

_NAMES = {"PostLocalSGDOptimizerState": "post_local_sgd_optimizer"}  # ours that wrap ours


class Place(NamedTuple):
    """Where a state sits: for each chain on the path from the root, ``(chain, index)``."""

    state: Any
    chains: tuple[tuple[Any, int], ...]


def _is_chain(x: Any, known: bool = False) -> bool:
    """An optax.chain (plain tuple) or named_chain (OrderedDict) state: a sequence of
    transformation states. ``known``: the optimizer says this tuple is a chain's (see
    :func:`chain_paths`). Otherwise a transformation's state may itself be a tuple (a
    wrapper of one's own keeping ``(inner_state, count)``), so a tuple that holds bare
    arrays is taken for a chain only when two or more of its items are not bare."""
    if isinstance(x, collections.OrderedDict):
        return True
    if not isinstance(x, (tuple, list)) or hasattr(x, "_fields"):
        return False
    if known:
        return True
    bare = sum(isinstance(c, (jax.Array, np.ndarray, np.generic, int, float)) for c in x)
    return not bare or len(x) - bare >= 2


def chain_paths(tx: Any) -> frozenset[tuple[int, ...]]:
    """Where ``tx``'s state holds ``optax.chain`` states: each an index path from the
    root through chains (``()``: the root), as far as chains nest directly in chains.

    Example:
      >>> import optax
      >>> from lsgd_jax.step import _chain_order
      >>> tx = optax.chain(optax.chain(optax.clip(1.0)), optax.sgd(0.1))
      >>> sorted(_chain_order.chain_paths(tx))
      [(), (0,), (1,)]
    """
    found: set[tuple[int, ...]] = set()

    def walk(init: Any, path: tuple[int, ...]) -> None:
        inits = _compat.chain_inits(init)
        if inits is not None:
            found.add(path)
            for i, sub in enumerate(inits):
                walk(sub, (*path, i))

    walk(getattr(tx, "init", None), ())
    return frozenset(found)


def _children(x: Any) -> list[Any]:
    """The fields (or items) of a wrapper's state, in order."""
    if hasattr(x, "_fields"):  # a NamedTuple (optax's states)
        return [getattr(x, name) for name in x._fields]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [getattr(x, f.name) for f in dataclasses.fields(x)]
    if isinstance(x, dict):
        return list(x.values())
    return list(x) if isinstance(x, (tuple, list)) else []


def places(opt_state: Any, chains: frozenset = frozenset()) -> Iterator[Place]:
    """Every hook and averager state of ``opt_state`` with the chains around it
    (``chains``: :func:`chain_paths` of the optimizer, where known).

    Example:
      >>> import optax, lsgd_jax
      >>> from lsgd_jax.step import _chain_order
      >>> tx = optax.chain(optax.clip(1.0), lsgd_jax.post_local_sgd(4), optax.sgd(0.1))
      >>> [(type(p.state).__name__, [i for _, i in p.chains])
      ...  for p in _chain_order.places(tx.init({}))]
      [('PostLocalSGDState', [1])]
    """

    def walk(x: Any, chains_around: tuple, path: tuple[int, ...] | None) -> Iterator[Place]:
        x = sp.read_through(x)  # an nnx.Optimizer: its optax state
        if sp.is_state(x):
            yield Place(x, chains_around)
        elif _is_chain(x, known=path in chains):
            for i, child in enumerate(_items(x)):
                inner = (*path, i) if path is not None else None
                yield from walk(child, (*chains_around, (x, i)), inner)
        else:
            for child in _children(x):
                yield from walk(child, chains_around, None)

    yield from walk(opt_state, (), ())


def describe(x: Any, chain: bool = False) -> str:
    """A chain state as the order of its transformations, by their state types
    (``chain``: ``x`` is known to be a chain's state).

    Example:
      >>> import optax, lsgd_jax
      >>> from lsgd_jax.step import _chain_order
      >>> tx = optax.chain(optax.adam(1e-3), lsgd_jax.post_local_sgd(4))
      >>> _chain_order.describe(tx.init({}))
      'chain(chain(ScaleByAdamState, EmptyState), post_local_sgd)'
    """
    if sp.is_kind(x, sp.HOOK):
        return "post_local_sgd"
    if sp.is_kind(x, sp.AVERAGER):
        return "model_averaging"
    if _NAMES.get(type(x).__name__):
        return _NAMES[type(x).__name__]
    if _is_chain(x, chain) and isinstance(x, dict):
        return "named_chain(" + ", ".join(f"{k}={describe(v)}" for k, v in x.items()) + ")"
    if _is_chain(x, chain):
        return "chain(" + ", ".join(describe(c) for c in x) + ")"
    inner = [describe(c) for c in _children(x) if _holds_ours(c)]
    name = type(x).__name__
    return f"{name}({', '.join(inner)})" if inner else name


def _items(chain: Any) -> list[Any]:
    return list(chain.values()) if isinstance(chain, dict) else list(chain)


def _holds_ours(x: Any) -> bool:
    return any(True for _ in places(x))


def _misplaced(place: Place, want_first: bool) -> tuple[Any, int] | None:
    """The innermost chain in which the state is not where it belongs, and its index."""
    for chain, index in reversed(place.chains):
        last = len(chain) - 1
        if (want_first and index != 0) or (not want_first and index != last):
            return chain, index
    return None


def check(opt_state: Any, tx: Any = None) -> None:
    """Raises a ValueError when something comes before the hook or after the averaging.

    Args:
      opt_state: an optax state (per-replica or not).
      tx: the optimizer, if known: where its state holds chains is then read from it.

    Raises:
      ValueError: with the order found and the order wanted.

    Example:
      >>> import optax, lsgd_jax
      >>> from lsgd_jax.step import _chain_order
      >>> tx = optax.chain(lsgd_jax.post_local_sgd(4),
      ...     lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, warmup_steps=4)),
      ...     optax.adam(1e-3))
      >>> _chain_order.check(tx.init({}))
      Traceback (most recent call last):
      ...
      ValueError: model_averaging must come last in the optax.chain, ...
    """
    for place in places(opt_state, chain_paths(tx)):
        hook = place.state.KIND == sp.HOOK
        found = _misplaced(place, want_first=hook)
        if found is None:
            continue
        chain, index = found
        items = _items(chain)
        ours = describe(place.state)
        holder = (
            "it" if items[index] is place.state else f"{describe(items[index])}, which holds it,"
        )
        if items[index] is not place.state and _NAMES.get(type(items[index]).__name__):
            ours, holder = describe(items[index]), "it"
        where = f"{holder} sits at position {index} of {describe(chain, chain=True)}"
        if hook:
            raise ValueError(
                f"{ours} must come first in the optax.chain, but {where}: what comes "
                "before it changes each replica's raw gradients before they are averaged "
                "(an optimizer before it would average the optimizer's updates, and each "
                "replica's moments would drift apart). Put it first: optax.chain(lsgd_jax."
                "post_local_sgd(...), <gradient transforms, e.g. optax.clip_by_global_norm"
                f"(1.0)>, optimizer, lsgd_jax.model_averaging(...)). {_MEANT}"
            )
        raise ValueError(
            f"{ours} must come last in the optax.chain, but {where} (the last position is "
            f"{len(items) - 1}): what comes after it rescales or replaces the updates that "
            "move each replica to the mean, so the models are never averaged (the replicas "
            "drift apart). Put it last: optax.chain(lsgd_jax.post_local_sgd(...), optimizer, "
            f"lsgd_jax.model_averaging(...)). {_MEANT}"
        )


_MEANT = (
    "If this order is meant, pass check_order=False to data_parallel_step (or to "
    "check_configuration)."
)
