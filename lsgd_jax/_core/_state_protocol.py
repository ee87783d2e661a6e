"""One protocol for the hook's and the averagers' states: each field's role, said once.

A state field is declared with :func:`field` and a role; everything that handles states
in general (phase programs, offload, checkpoints and their resize, the elastic heal, the
replicas' sync check) asks for fields by role instead of naming them, so a new field is
handled everywhere by declaring its role where the field is declared.

Roles of the children (arrays or subtrees):

- ``COUNTER``: an int32 scalar that every replica holds alike; the phase comes from the
  counters alone. A resize copies it (the saved replicas must agree), a snapshot reads
  it as a host int.
- ``BUFFER``: per-replica values an option keeps (shaped like the params: an anchor, an
  outer optimizer's state, a delayed average). Offloadable to host memory; a resize
  averages it; a snapshot drops it.
- ``RESIDUAL``: per-replica values that belong to this replica's own rounding (error
  feedback). As a buffer, except that a replica joining an elastic run starts it at zero.
- ``FLAG``: a bool, whether any replica's group did something (``skipped``); a resize
  keeps whether any saved replica's did.

Static metadata (part of the tree structure):

- ``CONFIG``: the configuration (axes, the averager, ...), described in checkpoints.
- ``PIN``: the phase a step specialized per phase pins (``pinned_phase``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import numpy as np

from lsgd_jax._core._struct import Struct

COUNTER = "counter"
BUFFER = "buffer"
RESIDUAL = "residual"
FLAG = "flag"
CONFIG = "config"
PIN = "pin"
STATIC_ROLES = frozenset({CONFIG, PIN})
HOOK = "hook"  # a PhasedState's KIND: the gradient hook's state (first in its chain)
AVERAGER = "averager"  # a model averager's state (last in its chain)
ROLES = frozenset({COUNTER, BUFFER, RESIDUAL, FLAG}) | STATIC_ROLES


def field(role: str, *, added: bool = False, **kwargs: Any) -> Any:
    """A state's dataclass field with its ``role`` (static metadata for CONFIG and PIN).

    Args:
      role: one of ``COUNTER``, ``BUFFER``, ``RESIDUAL``, ``FLAG``, ``CONFIG``, ``PIN``.
      added: a data field added after checkpoints of the state were saved: left out of
        the tree while it is None, so old checkpoints keep their structure (give it
        ``default=None``).
      **kwargs: passed to ``dataclasses.field`` (e.g. ``default=None``).

    Returns:
      A ``dataclasses.Field``.

    Example:
      >>> from lsgd_jax._core import _state_protocol as sp
      >>> f = sp.field(sp.CONFIG, default=None)
      >>> f.metadata["role"], f.metadata["static"]
      ('config', True)
    """
    if role not in ROLES:
        raise ValueError(f"unknown state field role {role!r}; one of {sorted(ROLES)}.")
    metadata = dict(kwargs.pop("metadata", {}) or {}, role=role, static=role in STATIC_ROLES)
    if added:
        if role in STATIC_ROLES or kwargs.get("default", dataclasses.MISSING) is not None:
            raise ValueError("an added field is a data field with default=None")
        metadata["omit_if_none"] = True
    return dataclasses.field(metadata=metadata, **kwargs)


def roles(state: Any) -> dict[str, str]:
    """``{field name: role}`` of a state (or state type), in declaration order."""
    return {f.name: f.metadata["role"] for f in dataclasses.fields(state)}


def names(state: Any, *wanted: str) -> tuple[str, ...]:
    """The names of ``state``'s fields whose role is one of ``wanted``.

    Example:
      >>> import lsgd_jax
      >>> from lsgd_jax._core import _state_protocol as sp
      >>> sp.names(lsgd_jax.ModelAveragerState, sp.COUNTER)
      ('step', 'outer_count', 'last_sync')
    """
    return tuple(n for n, r in roles(state).items() if r in wanted)


def data_names(state: Any) -> tuple[str, ...]:
    """The names of ``state``'s children (every role but the static ones)."""
    return tuple(n for n, r in roles(state).items() if r not in STATIC_ROLES)


def _first(x: Any) -> int:
    """The first value of a counter (per-replica or not) as a Python int; the replicas'
    counters agree, so any process reads its own shard."""
    if isinstance(x, jax.Array):
        x = x.addressable_data(0)
    return int(np.asarray(x).reshape(-1)[0])


class PhasedState(Struct):
    """The protocol of the hook's and the averagers' states.

    A subclass declares its fields with :func:`field`, names its main counter in
    ``COUNTER_FIELD`` (the one a sync check reports), says what it is in ``KIND``
    (:data:`HOOK` or :data:`AVERAGER`: where a chain wants it and what it averages)
    and has a ``pinned_phase`` PIN field; it gives ``num_phases``, ``phase`` (from its
    counters, on the device) and ``phase_digits`` (the same, replayed on the host).
    """

    COUNTER_FIELD: ClassVar[str]
    KIND: ClassVar[str]
    pinned_phase: int | None

    @property
    def counter(self) -> Any:
        """The main step counter (the hook's ``iter``, an averager's ``step``)."""
        return getattr(self, self.COUNTER_FIELD)

    @property
    def num_phases(self) -> int:
        """How many branches this state's transform has."""
        raise NotImplementedError

    @property
    def phase(self) -> jax.Array:
        """This call's branch, an int32 scalar from the counters alone."""
        raise NotImplementedError

    def phase_digits(self, num_steps: int) -> list[int]:
        """This state's phase at each of the next ``num_steps`` calls, replayed on the
        host from a :meth:`snapshot`."""
        raise NotImplementedError

    def calls_left(self) -> int | None:
        """Calls before a counter meets a limit it cannot pass (None: none)."""
        return None

    def pin(self, phase: int | None) -> PhasedState:
        """This state with its branch pinned to ``phase`` (None: unpinned)."""
        return self.replace(pinned_phase=phase)

    def snapshot(self) -> PhasedState:
        """The counters as host ints and nothing else: what a replay needs (a few ints,
        read from this process's own shards)."""
        changes = {
            n: (None if getattr(self, n) is None else _first(getattr(self, n)))
            if r == COUNTER
            else None
            for n, r in roles(self).items()
            if r not in STATIC_ROLES
        }
        return self.replace(**changes)


def is_state(x: Any) -> bool:
    """Whether ``x`` is a hook's or an averager's state (a :class:`PhasedState`)."""
    return isinstance(x, PhasedState)


def is_kind(x: Any, kind: str) -> bool:
    """Whether ``x`` is a state of ``kind`` (:data:`HOOK` or :data:`AVERAGER`)."""
    return is_state(x) and x.KIND == kind


def states(tree: Any, kind: str | None = None) -> list[PhasedState]:
    """The states in ``tree`` (of ``kind`` only, when given), in tree order.

    Example:
      >>> import optax, lsgd_jax
      >>> from lsgd_jax._core import _state_protocol as sp
      >>> tx = optax.chain(lsgd_jax.post_local_sgd(4), optax.sgd(0.1),
      ...     lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, warmup_steps=4)))
      >>> [s.KIND for s in sp.states(tx.init({}))], len(sp.states(tx.init({}), sp.HOOK))
      (['hook', 'averager'], 1)
    """
    wanted = is_state if kind is None else (lambda x: is_kind(x, kind))
    return [x for x in jax.tree.leaves(read_through(tree), is_leaf=is_state) if wanted(x)]


def read_through(tree: Any) -> Any:
    """``tree``, or the optax state of a ``flax.nnx.Optimizer`` (its ``opt_state``).

    Raises:
      TypeError: ``tree`` is an NNX ``State`` that holds an optimizer's state
        (``nnx.state(optimizer)``): NNX flattens optax's states into dicts there, so
        the chain's order and the step counters are gone; the message says to pass
        ``optimizer.opt_state``.

    Example:
      >>> from lsgd_jax._core import _state_protocol as sp
      >>> sp.read_through({"w": 1})
      {'w': 1}
    """
    module = type(tree).__module__ or ""
    if not module.startswith("flax.nnx"):
        return tree
    if isinstance(tree, Mapping):
        if "opt_state" in tree:
            raise TypeError(
                "got an NNX State of an optimizer (nnx.state(optimizer)): NNX flattens "
                "optax's states into dicts there, so the post-local SGD states (the chain's "
                "order, the step counters) are not in it. Pass the optimizer's optax state, "
                "optimizer.opt_state (or the nnx.Optimizer itself)."
            )
        return tree
    if not hasattr(tree, "opt_state"):
        return tree
    # an nnx.Optimizer: its optax state, each NNX variable replaced by its value
    return jax.tree.map(_value, tree.opt_state, is_leaf=_is_nnx_variable)


def _is_nnx_variable(x: Any) -> bool:
    return (type(x).__module__ or "").startswith("flax.nnx") and hasattr(x, "value")


def _value(x: Any) -> Any:
    return x.value if _is_nnx_variable(x) else x


def leaf_roles(tree: Any) -> list[str | None]:
    """The role of each leaf of ``tree`` (in flatten order): that of the state field
    holding it, or None for a leaf outside any state (params, an optimizer's moments).

    Example:
      >>> import jax.numpy as jnp, lsgd_jax
      >>> from lsgd_jax._core import _state_protocol as sp
      >>> avg = lsgd_jax.PeriodicModelAverager(2, delta=True)
      >>> sp.leaf_roles({"w": jnp.ones(2), "s": avg.init(jnp.ones(2))})
      ['counter', 'buffer', None]
    """

    def mark(node: Any) -> Any:
        if not is_state(node):
            return _Role(None)
        marked = {
            n: jax.tree.map(lambda _, r=r: _Role(r), getattr(node, n))
            for n, r in roles(node).items()
            if r not in STATIC_ROLES
        }
        return node.replace(**marked)

    return [m.role for m in jax.tree.leaves(jax.tree.map(mark, tree, is_leaf=is_state))]


@dataclasses.dataclass(frozen=True)
class _Role:  # not a pytree: a leaf
    role: str | None
