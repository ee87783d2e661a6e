"""Phases: which branch each hook and averager of an optimizer state takes this step.

The hook branches on its counter (global or node-local gradient mean), each averager on
its level (no average, or one group's). Each state type says how many phases it has
(``num_phases``) and which one it is in (``phase``, from its counters alone, so the same
on every replica). An optimizer state's phase is the mixed-radix number of its states'
phases, in tree order: ``phase_index``.

Whoever specializes a step per phase (``data_parallel_step``) traces the update once per
phase with every state *pinned*: ``pin`` writes the phase into each state's static
metadata (``pinned_phase``), and the hook and the averagers then take that branch as
straight-line code, without a ``lax.cond``. Being static metadata, the pin is part of the
state's tree structure, so a ``jax.jit``, ``jax.checkpoint`` or ``lax.scan`` around the
update traces each pinned state separately and never reuses a pinned trace for another
phase (a hidden trace-time context would be baked into such caches). ``unpin`` clears the
pins so that every branch returns the same structure.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lsgd_jax._core import _state_protocol as sp

_is_state = sp.is_state


def branching_states(opt_state: Any) -> list[Any]:
    """The hook and averager states with more than one phase, in tree order."""
    return [x for x in sp.states(opt_state) if x.num_phases > 1]


def num_phases(opt_state: Any) -> int:
    """How many phases a step with this optimizer state can be in.

    The product of the phases of its post_local_sgd hooks (2: global, node-local) and
    model averagers (one per level, plus "no average"); 1 when nothing branches.

    Args:
      opt_state: an optax state (per-replica or not).

    Returns:
      An int.

    Example:
      >>> import optax, lsgd_jax
      >>> tx = optax.chain(lsgd_jax.post_local_sgd(8), optax.sgd(0.1),
      ...     lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(4, warmup_steps=8)))
      >>> lsgd_jax.num_phases(tx.init({}))
      4
    """
    n = 1
    for state in branching_states(opt_state):
        n *= state.num_phases
    return n


def phase_index(opt_state: Any) -> jax.Array:
    """Which phase this step is in: the mixed-radix number of the states' phases.

    In tree order, each hook contributes its phase (1 before the switch, global mean; 0
    after) and each averager its level (0: no average), with the radix of its number of
    phases; states with a single phase are left out. The same on every replica, as it
    comes from the step counters only. ``data_parallel_step`` runs the branch of this
    index, and :func:`communication_report` names a collective's ``branch`` by it.

    Args:
      opt_state: an optax state, unbatched (inside ``shard_map``, or one replica's).

    Returns:
      An int32 scalar in ``range(num_phases(opt_state))``.

    Example:
      >>> import optax, lsgd_jax
      >>> tx = optax.chain(lsgd_jax.post_local_sgd(8), optax.sgd(0.1),
      ...     lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(4, warmup_steps=8)))
      >>> int(lsgd_jax.phase_index(tx.init({})))   # global gradients, no average
      2
    """
    index = jnp.zeros([], jnp.int32)
    for state in branching_states(opt_state):
        index = index * state.num_phases + state.phase
    return index


def pin(opt_state: Any, index: int) -> Any:
    """``opt_state`` with every branching state pinned to its digit of phase ``index``."""
    leaves, treedef = jax.tree.flatten(opt_state, is_leaf=_is_state)
    branching = [i for i, x in enumerate(leaves) if _is_state(x) and x.num_phases > 1]
    for i in reversed(branching):  # the last state is the lowest digit
        index, digit = divmod(index, leaves[i].num_phases)
        leaves[i] = leaves[i].pin(digit)
    return jax.tree.unflatten(treedef, leaves)


def unpin(opt_state: Any) -> Any:
    """``opt_state`` with every pin cleared."""
    return jax.tree.map(
        lambda x: x.pin(None) if _is_state(x) else x,
        opt_state,
        is_leaf=_is_state,
    )


def counters_snapshot(opt_state: Any) -> list[Any]:
    """The branching states with their counters as host ints and nothing else: what a
    replay needs, read from this process's own shards (a few ints, any process)."""
    return [state.snapshot() for state in branching_states(opt_state)]


def replay_digits(opt_state: Any, num_steps: int) -> np.ndarray:
    """Each branching state's phase at each of the next ``num_steps`` steps, replayed in
    plain Python: an int array ``[states, steps]`` (see :func:`replay_phases`)."""
    rows = [state.snapshot().phase_digits(num_steps) for state in branching_states(opt_state)]
    return np.asarray(rows, np.int64).reshape(len(rows), num_steps)


def calls_left(opt_state: Any) -> int | None:
    """How many calls from these counters can run before an averager's step counter
    reaches the int32 maximum under a schedule that cannot continue past it (a callable
    period): the call there raises OverflowError. None: every counter can go on.

    Example:
      >>> import jax.numpy as jnp, optax, lsgd_jax
      >>> from lsgd_jax.step._phase import calls_left
      >>> tx = lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(lambda s: 4))
      >>> state = tx.init({})
      >>> calls_left(state) == 2**31 - 1, calls_left(state.replace(step=jnp.int32(2**31 - 3)))
      (True, 2)
    """
    rooms = [state.snapshot().calls_left() for state in branching_states(opt_state)]
    return min((r for r in rooms if r is not None), default=None)


def replay_phases(opt_state: Any, num_steps: int) -> np.ndarray:
    """The phase index of each of the next ``num_steps`` steps, replayed in plain Python.

    From the counters in ``opt_state`` (per-replica or not; replica 0's are read), each
    hook and averager is stepped by its own rule (``sync_schedule``), assuming one update
    per step (under ``optax.MultiSteps`` the states advance once per emitted update).
    What benchmarks and examples use to know, without running anything, which branch of
    the step (and so which collectives) each step takes.

    Args:
      opt_state: an optax state, e.g. ``tx.init(params)`` or a replicated one.
      num_steps: how many steps.

    Returns:
      An int32 array of :func:`phase_index` values, one per step.

    Raises:
      OverflowError: the steps include one where an averager's step counter is at the
        int32 maximum and its schedule cannot continue past it (a callable period, or
        periods whose cycle is longer than the counter's range): the step fails there on
        the device too, with the same message, which says what to do.

    Example:
      >>> import optax, lsgd_jax
      >>> tx = optax.chain(lsgd_jax.post_local_sgd(2), optax.sgd(0.1),
      ...     lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, warmup_steps=2)))
      >>> lsgd_jax.replay_phases(tx.init({}), 6).tolist()   # hook 1 then 0; averages at 2, 4
      [2, 2, 1, 0, 1, 0]
    """
    index = np.zeros(num_steps, np.int64)
    for state, digits in zip(branching_states(opt_state), replay_digits(opt_state, num_steps)):
        index = index * state.num_phases + digits
    return index.astype(np.int32)
