"""Which compiled program each call of data_parallel_step runs: a plan kept on the host.

With one program per phase, the step must know each call's phase before it dispatches,
without waiting for the device. The plan reads the step counters of a state it has not
seen (the first call, a restored or handed-over state) once, replays the schedule in
plain Python (``_phase.replay_phases``), and then advances one phase per call for as
long as it is given back the state the step returned. States under wrappers that may
skip an update (``optax.MultiSteps`` and friends), or built with ``specialize`` other
than True, run one fixed program instead. No devices are needed to test it.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

from lsgd_jax.step import _phase, _step_inputs

# Wrappers whose inner state (ours inside) may skip an update: the host cannot follow
# the counters through them, so such steps branch on the device ("switch").
SKIPPING_WRAPPERS = (
    optax.MultiStepsState,
    optax.ApplyIfFiniteState,
    optax.ConditionallyTransformState,
    optax.ConditionallyMaskState,
    optax.MaskedState,
)


def skips_on_device(opt_state: Any) -> bool:
    """Whether ``opt_state`` holds a wrapper that may skip an update on the device (then
    the phase of a call cannot be replayed on the host)."""
    nodes = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, SKIPPING_WRAPPERS))
    return any(isinstance(x, SKIPPING_WRAPPERS) for x in nodes)


class PhasePlan:
    """Follows the step counters on the host, one phase per call.

    Args:
      specialize: ``data_parallel_step``'s ``specialize`` (``"phase"``, ``"switch"`` or
        ``"cond"``; True and False are aliases of the first and the last).

    Example:
      >>> import optax, lsgd_jax
      >>> from lsgd_jax.step._phase_plan import PhasePlan
      >>> tx = optax.chain(lsgd_jax.post_local_sgd(2), optax.sgd(0.1),
      ...     lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, warmup_steps=2)))
      >>> plan, state = PhasePlan("phase"), tx.init({})
      >>> modes = []
      >>> for _ in range(4):
      ...     modes.append(plan.mode(state))
      ...     plan.advance(state)     # as if the step had returned this state
      >>> modes
      [2, 2, 1, 0]
    """

    _CHUNK = 8  # steps replayed at a time

    def __init__(self, specialize: bool | str) -> None:
        self._specialize = _step_inputs.specialize_mode(specialize)
        self._fixed: dict[Any, int | str | None] = {}
        self._phases = np.zeros(0, np.int64)
        self._snapshot: Any = None
        self._room: int | None = None  # calls the snapshot's counters can run (None: all)
        self._position = 0  # index into _phases of the next call
        self._returned: Any = None  # the state the last call returned

    def fixed_mode(self, opt_state: Any) -> int | str | None:
        """The one program every call with states of this structure runs (``"switch"``
        or ``"cond"``), or None: one program per phase (cached by tree structure)."""
        treedef = jax.tree.structure(opt_state)
        if treedef not in self._fixed:
            fixed: int | str | None = None
            if self._specialize != "phase" or _phase.num_phases(opt_state) == 1:
                fixed = "cond" if self._specialize == "cond" else "switch"
            elif skips_on_device(opt_state):
                fixed = "switch"
            self._fixed[treedef] = fixed
        return self._fixed[treedef]

    def mode(self, opt_state: Any) -> int | str:
        """The program of this call: its phase (an int) or a fixed program's name.

        A state other than the one the last call returned (``is``) restarts the plan from
        its counters, which waits for that state to be computed.

        Raises:
          OverflowError: this call's averager step counter is at the int32 maximum and
            its schedule cannot continue past it (``_phase.replay_phases``'s message, the
            one the device raises there), before anything runs.
        """
        if self._snapshot is not None and opt_state is self._returned:
            fixed = None  # the plan goes on: its structure was keyed when it started
        else:
            fixed = self.fixed_mode(opt_state)
        if fixed is not None:
            return fixed
        if self._snapshot is None or opt_state is not self._returned:
            self._snapshot = _phase.counters_snapshot(opt_state)
            self._room = _phase.calls_left(self._snapshot)
            self._position = 0
            self._phases = self._replay(self._CHUNK, needed=1)
        if self._position >= len(self._phases):
            size = max(2 * len(self._phases), self._position + 1)
            self._phases = self._replay(size, needed=self._position + 1)
        return int(self._phases[self._position])

    def _replay(self, num_steps: int, needed: int) -> np.ndarray:
        """The phases of the next ``num_steps`` calls from the snapshot, cut short before
        the first call whose step counter cannot advance (at the int32 maximum, under a
        schedule without a cycle) unless it is among the first ``needed``: then the
        replay raises its OverflowError. Replayed ahead of time, that call would fail
        one that can still run."""
        if self._room is not None:  # past it, exactly up to the first call that fails
            num_steps = min(num_steps, self._room) if needed <= self._room else needed
        return _phase.replay_phases(self._snapshot, num_steps)

    def coming(self, num_calls: int) -> list[int]:
        """The phases of the next ``num_calls`` calls after the last one planned, in the
        order they first occur (none when calls run a fixed program)."""
        if self._snapshot is None:
            return []
        end = self._position + num_calls
        cut = self._room is not None and len(self._phases) >= self._room
        if end > len(self._phases) and not cut:  # cut: none beyond the counters' end
            self._phases = self._replay(max(end, 2 * len(self._phases)), needed=0)
        return list(dict.fromkeys(int(k) for k in self._phases[self._position : end]))

    def replay(self, opt_state: Any, num_steps: int) -> list[int | str]:
        """The program of each of the next ``num_steps`` calls from ``opt_state`` (the
        plan itself is left as it is); OverflowError when those calls include one that
        cannot run (see :meth:`mode`)."""
        fixed = self.fixed_mode(opt_state)
        if fixed is not None:
            return [fixed] * num_steps
        return _phase.replay_phases(_phase.counters_snapshot(opt_state), num_steps).tolist()

    def advance(self, returned: Any) -> None:
        """After a phase program ran: the next call continues the plan with ``returned``."""
        self._position += 1
        self._returned = returned
