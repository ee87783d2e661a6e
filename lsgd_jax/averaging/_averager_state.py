"""ModelAveragerState: what an averager carries from one call to the next."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from lsgd_jax import comm
from lsgd_jax._core import _leaves
from lsgd_jax._core import _state_protocol as sp
from lsgd_jax._core._struct import pytree_dataclass


@pytree_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class ModelAveragerState(sp.PhasedState):
    """The state of a model averager: its step count, and (static) which averager.

    A pytree. ``averager`` is static metadata, so a training loop can tell from an
    optimizer state alone when, and over which group, the models were averaged (e.g. to
    average batch-norm statistics on the same steps). The other fields are None unless
    an option of the averager needs them.

    Attributes:
      step: int32 scalar, the number of ``average_parameters`` calls so far (PyTorch's
        ``averager.step``). At the int32 maximum it continues from an earlier step at the
        same place in the schedule (whole cycles back, see ``averager.cycle``), so the
        averages stay on schedule; a schedule without a cycle (a callable period) raises
        OverflowError there instead.
      averager: the PeriodicModelAverager or HierarchicalModelAverager that owns it.
      anchor: the params at the last global average (``outer_optimizer``, ``delta``).
      outer_state: the outer optimizer's state.
      outer_count: int32 scalar, the global averages so far (``outer_optimizer``).
      last_sync: int32 scalar, the step of the last average (a callable ``period``).
      comm_state: the communication strategy's per-replica state (None for the
        stateless ones).
      inflight_start: with ``delay``: this replica's params when the global average in
        flight started (``s``).
      inflight_mean: with ``delay``: that average (or the outer optimizer's new global
        params), which lands ``delay`` calls after it started as ``params + (mean - s)``.
      skipped: with a non-finite policy (a ``comm.finite_only`` strategy): bool scalar,
        whether this replica's group skipped the last average (``"skip"`` with a
        non-finite replica, ``"exclude"`` with no finite one); ``data_parallel_step``'s
        model state follows it. A state shared by every replica (passed unmapped) holds
        whether any group skipped (one more one-value all-reduce at a level narrower
        than the state).
      pinned_phase: None, or (static) the level this call takes whatever the counters
        say: set by whoever specializes a step per phase (see :func:`phase_index`), in
        the static metadata so that every trace cache keys on it.

    Example:
      >>> import lsgd_jax
      >>> state = lsgd_jax.PeriodicModelAverager(4).init()
      >>> int(state.step), state.averager.period
      (0, 4)
    """

    COUNTER_FIELD = "step"
    KIND = sp.AVERAGER

    step: jax.Array = sp.field(sp.COUNTER)
    # described field by field in a checkpoint; blanked in its structure (the format of
    # saved checkpoints: never change it)
    averager: Any = sp.field(
        sp.CONFIG, default=None, metadata={"checkpoint": "fields", "blank": None}
    )
    anchor: Any = sp.field(sp.BUFFER, default=None)
    outer_state: Any = sp.field(sp.BUFFER, default=None)
    outer_count: Any = sp.field(sp.COUNTER, default=None)
    last_sync: Any = sp.field(sp.COUNTER, default=None)
    comm_state: Any = sp.field(sp.RESIDUAL, default=None)
    inflight_start: Any = sp.field(sp.BUFFER, default=None)
    inflight_mean: Any = sp.field(sp.BUFFER, default=None)
    skipped: Any = sp.field(sp.FLAG, default=None)
    pinned_phase: int | None = sp.field(sp.PIN, default=None)

    @property
    def num_phases(self) -> int:
        """The number of branches the averager has (one per level, plus "no average"; with a
        delay, each with and without a landing average)."""
        return 1 if self.averager is None else self.averager.sync_schedule.num_phases

    @property
    def phase(self) -> jax.Array:
        """This state's phase, the level of this call (0 for no average), as an int32 scalar
        derived from the counters alone (the same on every replica).

        Example:
          >>> import lsgd_jax
          >>> int(lsgd_jax.PeriodicModelAverager(4, warmup_steps=1).init().phase)
          0
        """
        if self.averager is None:
            return jnp.zeros([], jnp.int32)
        schedule = self.averager.sync_schedule
        return jnp.asarray(schedule.phase(self.step, self.last_sync), jnp.int32)

    def phase_digits(self, num_steps: int) -> list[int]:
        """The level at each of the next ``num_steps`` calls, replayed on the host from
        a snapshot's counters (host ints); OverflowError where the schedule cannot
        continue (see ``sync_schedule.check_calls``)."""
        schedule = self.averager.sync_schedule
        step = int(self.step)
        schedule.check_calls(step, num_steps, type(self.averager).__name__)
        last = 0 if self.last_sync is None else int(self.last_sync)
        digits = []
        for s in range(step, step + num_steps):
            digits.append(schedule.phase(s, last))
            last = s if schedule.level(s, last) else last
        return digits

    def calls_left(self) -> int | None:
        """Calls before the step counter meets the int32 maximum under a schedule that
        cannot continue past it (None: it can go on); from a snapshot."""
        return self.averager.sync_schedule.calls_left(int(self.step))


def check_state(state: Any, what: str, averager: Any) -> None:
    if not isinstance(state, ModelAveragerState):
        raise TypeError(
            f"{what} expects a ModelAveragerState (from averager.init()), got "
            f"{type(state).__name__}."
        )
    if state.averager is not None and state.averager != averager:
        raise ValueError(
            f"{what}: this state belongs to {state.averager!r}, not to {averager!r}; "
            "use the state that this averager's init() made."
        )
    missing = averager.parts.needs_anchor and state.anchor is None
    if missing or (averager.delay and state.inflight_start is None):
        raise ValueError(
            f"{what}: {type(averager).__name__} with outer_optimizer, delta or delay keeps "
            "params (the last global average's, or the one in flight) in its state; create "
            "the state with averager.init(params)."
        )


def initial_state(averager: Any, params: Any = None) -> ModelAveragerState:
    """``averager.init(params)``: step 0, and what the averager's options keep.

    The anchor and the outer optimizer's state need the params (an error says so when
    they are missing); a callable period keeps the step of the last average; the
    communication strategy its own state.
    """
    if params is not None:  # a function or a flag of a whole model object: named here
        _leaves.refuse_non_arrays(params, f"{type(averager).__name__}: init(params)")
    state = ModelAveragerState(step=jnp.zeros([], jnp.int32), averager=averager)
    if averager.needs_params and params is None:
        raise ValueError(
            f"{type(averager).__name__} with outer_optimizer, delta or delay needs the "
            "initial params: call averager.init(params)."
        )
    parts = averager.parts
    if parts.needs_anchor:
        anchor = jax.tree.map(jnp.asarray, params)
        state = state.replace(anchor=anchor, **parts.then.init(anchor))
    if averager.sync_schedule.tracks_last_sync:
        state = state.replace(last_sync=jnp.zeros([], jnp.int32))
    if averager.delay:
        start = jax.tree.map(jnp.asarray, params)
        state = state.replace(inflight_start=start, inflight_mean=start)
    if averager.communicator.may_skip:
        state = state.replace(skipped=jnp.zeros([], bool))
    return state.replace(comm_state=comm.initial_state(averager.communicator, params))
