"""A schedule's step counter at the int32 limit: where it wraps and stays on schedule,
and where it cannot, one message for the device's check and the replays in Python."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

INT32_MAX = int(np.iinfo(np.int32).max)


def _counter_overflow(message: str, step: Any) -> None:
    del step  # always INT32_MAX: the message says so
    raise OverflowError(message)


def _period_name(period: Any) -> str:
    """A callable period as a reader knows it: its qualified name (``<lambda>`` for a
    lambda), not its repr with an address."""
    name = getattr(period, "__qualname__", None)
    return name.rsplit("<locals>.", 1)[-1] if isinstance(name, str) else repr(period)


class _CounterLimit:
    """The int32 limit of a schedule's step counter (a mixin of concrete helpers: the
    schedule gives ``cycle``, ``warmup_steps`` and ``delay``)."""

    warmup_steps: int
    delay: int = 0

    @property
    def cycle(self) -> int | None:
        raise NotImplementedError

    @property
    def wraps(self) -> bool:
        """Whether the step counter continues past the int32 maximum (see
        :meth:`next_step`): the schedule has a cycle that fits in the counter's range
        after the warm-up and delay. A callable period has none.

        Example:
          >>> from lsgd_jax.schedules._schedule import AdaptiveSchedule, PeriodicSchedule
          >>> PeriodicSchedule(4).wraps, AdaptiveSchedule(lambda s: 4).wraps
          (True, False)
        """
        cycle, span = self.cycle, INT32_MAX + 1 - self.warmup_steps - self.delay
        return cycle is not None and cycle <= span

    def calls_left(self, step: int) -> int | None:
        """How many calls from the counter value ``step`` can run: None when the counter
        wraps at the int32 maximum (every call can); else the calls before the one at
        the maximum, which cannot advance its counter and raises OverflowError.

        Example:
          >>> from lsgd_jax.schedules._schedule import AdaptiveSchedule
          >>> AdaptiveSchedule(lambda s: 4).calls_left(2**31 - 4)
          3
        """
        return None if self.wraps else max(INT32_MAX - int(step), 0)

    def check_calls(self, step: int, num_calls: int, name: str) -> None:
        """Raises OverflowError (the message of :meth:`next_step`'s device check) when the
        ``num_calls`` calls from the counter value ``step`` include the one at the int32
        maximum that this schedule cannot run past: what a replay in plain Python checks
        before it starts, so that it fails where the device would, with the same words.

        Args:
          step: the counter's value at the first call.
          num_calls: how many calls.
          name: who holds the schedule (e.g. the averager's class name), for the message.

        Raises:
          OverflowError: as said.

        Example:
          >>> from lsgd_jax.schedules._schedule import AdaptiveSchedule
          >>> AdaptiveSchedule(lambda s: 4).check_calls(2**31 - 4, 3, "avg")  # fine
          >>> AdaptiveSchedule(lambda s: 4).check_calls(2**31 - 4, 4, "avg")
          Traceback (most recent call last):
          ...
          OverflowError: replaying 4 calls from step 2147483644: call 4, at step 2147483647, ...
        """
        left = self.calls_left(step)
        if left is not None and num_calls > left:
            raise OverflowError(
                f"replaying {num_calls} call{'s' if num_calls > 1 else ''} from step "
                f"{int(step)}: call {left + 1}, at step {INT32_MAX}, cannot run. "
                + self.overflow_message(name)
            )

    def overflow_message(self, name: str) -> str:
        """Why the call at the int32 maximum fails, and what to do: one text for the
        device's check (:meth:`next_step`) and the replays in plain Python.

        Example:
          >>> from lsgd_jax.schedules._schedule import PeriodicSchedule
          >>> PeriodicSchedule(2**31, warmup_steps=2).overflow_message("avg")[:60]
          'avg (PeriodicSchedule(period=2147483648, warmup_steps=2)): t'
        """
        span = INT32_MAX + 1 - self.warmup_steps - self.delay
        if self.cycle is None:
            why = "a callable period has no cycle to continue the count from"
            fix = (
                "e.g. state.replace(step=state.step - k, last_sync=state.last_sync - k) "
                "(the period is then asked for step - k), or use an int period"
            )
        else:
            why = (
                f"its cycle of {self.cycle} steps does not fit in the counter's range "
                f"after the warm-up and delay ({span} steps)"
            )
            fix = (
                "e.g. state.replace(step=state.step - k), or use periods whose cycle "
                "(their least common multiple) is at most that range"
            )
        return (
            f"{name} ({self._describe()}): the averager's step counter reached the int32 "
            f"maximum at step {INT32_MAX} (after {INT32_MAX} calls), and this schedule "
            f"cannot be followed past it: {why}. Restore from a checkpoint with the "
            f"averager state's counters moved back by the same amount k, {fix}: such a "
            "counter wraps and runs forever."
        )

    def _describe(self) -> str:
        """The schedule as its constructor call, a callable period by its name."""
        shown = []
        for field in dataclasses.fields(self):  # type: ignore[arg-type]  # (subclasses are)
            value = getattr(self, field.name)
            if field.default is dataclasses.MISSING or value != field.default:
                text = _period_name(value) if callable(value) else repr(value)
                shown.append(f"{field.name}={text}")
        return f"{type(self).__name__}({', '.join(shown)})"

    def next_step(self, step: jax.Array, name: str) -> jax.Array:
        """``step + 1``, kept inside int32 without leaving the schedule.

        At the int32 maximum the count continues from an earlier step with the same
        place in the schedule (a whole number of cycles back, never below the warm-up),
        so the averages stay on schedule forever. A schedule without such a cycle
        (:attr:`wraps` False) raises OverflowError at that call (a host callback, with
        :meth:`overflow_message`) instead of drifting silently; the replays in plain
        Python refuse that call too (``check_calls``).

        Example:
          >>> import jax.numpy as jnp
          >>> from lsgd_jax.schedules._schedule import PeriodicSchedule
          >>> schedule = PeriodicSchedule(3, warmup_steps=1)   # step 2**31 - 1 + 1 is 2 later
          >>> int(schedule.next_step(jnp.int32(2**31 - 1), "avg"))
          2
        """
        if self.wraps:
            # never below warm-up + delay, so that "step - delay" keeps its level too
            cycle, span = self.cycle, INT32_MAX + 1 - self.warmup_steps - self.delay
            assert cycle is not None
            wrapped = INT32_MAX + 1 - cycle * (span // cycle)
            nxt = jnp.where(step == INT32_MAX, jnp.int32(wrapped), step + (step < INT32_MAX))
            return nxt.astype(jnp.int32)
        fail = functools.partial(_counter_overflow, self.overflow_message(name))
        lax.cond(step == INT32_MAX, lambda: jax.debug.callback(fail, step), lambda: None)
        return optax.safe_increment(step)
