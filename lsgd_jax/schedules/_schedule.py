"""When to average: schedules as small frozen values.

A schedule says, for each call of an averager (its step count ``s``, from 0), which
*level* averages: 0 for none, ``k`` for the k-th group (or fragment). It owns the rule,
its number of levels, which level is global, the length of its cycle, how the step
counter advances inside int32, and a plain-Python replay of the first steps that tests,
benchmarks and examples use to count averages. The averagers hold one
(``averager.sync_schedule``) and read it; they add the groups and the maths.

- :class:`PeriodicSchedule`: PyTorch's ``PeriodicModelAverager`` rule, optionally in
  ``fragments`` (Streaming DiLoCo).
- :class:`HierarchicalSchedule`: PyTorch's ``HierarchicalModelAverager`` rule.
- :class:`AdaptiveSchedule`: a period that is a function of the step (AdaComm); the
  only one whose level depends on the step of the last average, not on ``s`` alone.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lsgd_jax._core import _validate
from lsgd_jax.schedules._counter import INT32_MAX, _CounterLimit, _period_name


def _is_traced(*xs: Any) -> bool:
    return any(isinstance(x, jax.Array) for x in xs)


def _check_delay(delay: Any, limit: int, what: str) -> None:
    _validate.nonnegative_int(delay, "delay")
    if delay and delay >= limit:
        raise ValueError(
            f"delay={delay} must be below {what} ({limit}): one average in flight at a "
            f"time; use delay <= {limit - 1}."
        )


class Schedule(_CounterLimit):
    """When an averager averages: the base of every schedule, and the door for your own.

    A schedule is a frozen dataclass that says, for each call of the averager (its step
    count ``s``, from 0), which level averages: 0 for none, 1 for the averager's group.
    Pass one as ``PeriodicModelAverager(period=schedule)``. A subclass defines
    :meth:`level` (jit-able: ``step`` is an int32 array on the device and a Python int in
    host replays), and may set ``warmup_steps``, ``tracks_last_sync`` (True: ``level``
    reads the step of the last average, which the averager's state then keeps) and
    ``cycle`` (the period after which the levels repeat, if any: the int32 step counter
    can then wrap forever). The rest (phases, replays, the first global average, the
    counter's limit) follows from those.

    Example (a period that halves every 400 steps, from 32 down to 4):
      >>> import dataclasses, jax.numpy as jnp, lsgd_jax
      >>> @dataclasses.dataclass(frozen=True)
      ... class Shrinking(lsgd_jax.schedules.Schedule):
      ...     tracks_last_sync = True
      ...     def level(self, step, last_sync=None):
      ...         period = jnp.maximum(32 // 2 ** (step // 400), 4)
      ...         return ((step == 0) | (step - last_sync >= period)).astype(jnp.int32)
      >>> avg = lsgd_jax.PeriodicModelAverager(Shrinking())
      >>> int(avg.schedule(1200).sum())  # 13 + 25 + 50 averages, and the one at 0
      88
    """

    warmup_steps: int = 0
    delay: int = 0
    tracks_last_sync = False

    @property
    def num_levels(self) -> int:
        """The number of levels (groups, or fragments) that average; 1 by default."""
        return 1

    @property
    def cycle(self) -> int | None:
        """The period of the levels, or None if they never repeat (then the step
        counter cannot wrap)."""
        return None

    def level(self, step: Any, last_sync: Any = None) -> Any:
        """The level of the call at ``step`` (0 for no average, 1 for an average).

        ``step`` is an int32 array on the device and a Python int in host replays, so
        write the rule with ``jnp`` (``jnp.where``, ``jnp.asarray(step) % 4``), not with
        Python's ``if``. ``last_sync`` is the step of the last average when
        ``tracks_last_sync`` is True, else None.
        """
        raise NotImplementedError(f"{type(self).__name__} must define level(step, last_sync)")

    def is_global(self, level: int) -> bool:
        """Whether ``level`` is the widest group's (every fragment of a periodic one).

        Example:
          >>> from lsgd_jax.schedules._schedule import HierarchicalSchedule
          >>> [HierarchicalSchedule((2, 8)).is_global(k) for k in range(3)]
          [False, False, True]
        """
        return level > 0

    def first_global_step(self, fragment: int = 0) -> int:
        """The step of the first global average of ``fragment`` (0-based; 0 without
        fragments); until then the replicas' anchors may differ. By default the first
        step at or after the warm-up whose level is global, found by a host replay of
        at most ``cycle`` (or 10,000) steps, once per schedule (every averaging branch
        of every trace asks)."""
        del fragment
        try:
            return _first_global(self)
        except TypeError:  # a schedule with an unhashable field: no cache
            return _first_global.__wrapped__(self)

    def host_level(self, step: int, last_sync: int | None = None) -> int:
        """``level`` on the host, as a checked Python int (also while JAX traces a step:
        a rule written with ``jnp`` is evaluated, not traced).

        Raises:
          ValueError: the level is not an int from 0 to ``num_levels``.
        """
        with jax.ensure_compile_time_eval():
            got = np.asarray(self.level(step, last_sync if self.tracks_last_sync else None))
        level = int(got) if got.shape == () else -1
        if level != got or not 0 <= level <= self.num_levels:
            raise ValueError(
                f"{type(self).__name__}.level({step}) returned {got!r}: a level is an int "
                f"from 0 (no average) to num_levels ({self.num_levels}); return 1 where "
                "the call averages and 0 elsewhere."
            )
        return level

    @property
    def num_phases(self) -> int:
        """The number of branches of a call, "no average" and each level; with a
        ``delay``, each of those with and without the landing of the average started
        ``delay`` calls ago."""
        return (self.num_levels + 1) * (2 if self.delay else 1)

    def lands(self, step: Any) -> Any:
        """Whether a delayed global average started ``delay`` calls before ``step`` lands
        at ``step`` (False without a delay)."""
        if not self.delay:
            return jnp.zeros([], bool) if _is_traced(step) else False
        started = self.level(step - self.delay)
        if _is_traced(started):
            return (started > 0) & jnp.asarray(self._global_mask())[started]
        return bool(started) and self.is_global(int(started))

    def _global_mask(self) -> list[bool]:
        return [bool(k) and self.is_global(k) for k in range(self.num_levels + 1)]

    def phase(self, step: Any, last_sync: Any = None) -> Any:
        """The branch of the call at ``step``: its level, plus ``num_levels + 1`` when a
        delayed average lands there.

        Example:
          >>> from lsgd_jax.schedules._schedule import PeriodicSchedule
          >>> [PeriodicSchedule(4, delay=2).phase(s) for s in range(7)]
          [1, 0, 2, 0, 1, 0, 2]
        """
        level = self.level(step, last_sync)
        if not self.delay:
            return level
        lands = self.lands(step)
        if _is_traced(level, lands):
            return (level + (self.num_levels + 1) * lands).astype(jnp.int32)
        return int(level) + (self.num_levels + 1) * int(lands)

    def replay(self, num_steps: int) -> np.ndarray:
        """The level of every call from step 0 to ``num_steps - 1``, in plain Python.

        Raises:
          OverflowError: the calls include the one at the int32 maximum, which a schedule
            that does not wrap there cannot run (see ``check_calls``).

        Example:
          >>> from lsgd_jax.schedules._schedule import PeriodicSchedule
          >>> PeriodicSchedule(3, warmup_steps=1).replay(8).tolist()
          [0, 1, 0, 0, 1, 0, 0, 1]
        """
        self.check_calls(0, num_steps, type(self).__name__)
        out, last = [], 0
        for s in range(num_steps):
            level = self.host_level(s, last)
            out.append(level)
            last = s if level else last
        return np.asarray(out, np.int32)


@dataclasses.dataclass(frozen=True)
class PeriodicSchedule(Schedule):
    """Averages at ``s >= warmup_steps`` when ``(s - warmup_steps) % period == 0``.

    With ``fragments=K`` each of K fragments averages every ``period`` steps, the k-th
    offset by ``k * period / K``: level ``k + 1`` at ``s`` when ``(s - warmup_steps) %
    (period / K) == 0`` and ``(s - warmup_steps) // (period / K) % K == k``.

    Attributes:
      period: steps between averages (of one fragment).
      warmup_steps: steps before the first average.
      fragments: how many fragments take turns (1: the whole model every time).

    Example:
      >>> from lsgd_jax.schedules._schedule import PeriodicSchedule
      >>> PeriodicSchedule(4, fragments=2).replay(6).tolist()
      [1, 0, 2, 0, 1, 0]
    """

    period: int
    warmup_steps: int = 0
    fragments: int = 1
    delay: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "period", _validate.positive_int(self.period, "period"))
        warmup = _validate.nonnegative_int(self.warmup_steps, "warmup_steps")
        object.__setattr__(self, "warmup_steps", warmup)
        k = _validate.positive_int(self.fragments, "fragments")
        if self.period % k:
            raise ValueError(
                f"fragments={k} needs an int period divisible by it, got period="
                f"{self.period!r}; e.g. period={4 * k}."
            )
        object.__setattr__(self, "fragments", k)
        _check_delay(self.delay, self.period // k, "period / fragments" if k > 1 else "period")
        object.__setattr__(self, "delay", int(self.delay))

    @property
    def num_levels(self) -> int:
        return self.fragments

    @property
    def cycle(self) -> int:
        return self.period

    def is_global(self, level: int) -> bool:
        return level > 0

    def first_global_step(self, fragment: int = 0) -> int:
        return self.warmup_steps + fragment * (self.period // self.fragments)

    def level(self, step: Any, last_sync: Any = None) -> Any:
        """0 for no average, else the fragment number (1-based); a Python int for a
        Python ``step``, an int32 array for an array."""
        del last_sync
        stride = self.period // self.fragments
        after = step - self.warmup_steps
        on = (step >= self.warmup_steps) & (after % stride == 0)
        which = (after // stride) % self.fragments + 1
        if _is_traced(on, step):
            return jnp.where(on, which, 0).astype(jnp.int32)
        return int(which) if on else 0


@dataclasses.dataclass(frozen=True)
class HierarchicalSchedule(Schedule):
    """At ``s >= warmup_steps``, the LARGEST period dividing ``s`` picks the level.

    ``s``, not ``s - warmup_steps``, as PyTorch's ``HierarchicalModelAverager``.

    Attributes:
      periods: strictly increasing periods, one per level.
      warmup_steps: steps before the first average.

    Example:
      >>> from lsgd_jax.schedules._schedule import HierarchicalSchedule
      >>> HierarchicalSchedule((2, 4), warmup_steps=2).replay(9).tolist()
      [0, 0, 1, 0, 2, 0, 1, 0, 2]
    """

    periods: tuple[int, ...]
    warmup_steps: int = 0
    delay: int = 0

    def __post_init__(self) -> None:
        periods = tuple(_validate.positive_int(p, f"period {p!r}") for p in self.periods)
        if not periods or any(b <= a for a, b in zip(periods, periods[1:])):
            raise ValueError(
                f"The periods must be strictly increasing (smallest group first), got "
                f"{list(periods)}; order the dict by period."
            )
        object.__setattr__(self, "periods", periods)
        warmup = _validate.nonnegative_int(self.warmup_steps, "warmup_steps")
        object.__setattr__(self, "warmup_steps", warmup)
        _check_delay(self.delay, periods[-1], "the global period")
        object.__setattr__(self, "delay", int(self.delay))

    @property
    def num_levels(self) -> int:
        return len(self.periods)

    @property
    def cycle(self) -> int:
        return math.lcm(*self.periods)

    def is_global(self, level: int) -> bool:
        return level == self.num_levels

    def first_global_step(self, fragment: int = 0) -> int:
        del fragment  # the first multiple of the last period from the warm-up on
        return -(-self.warmup_steps // self.periods[-1]) * self.periods[-1]

    def level(self, step: Any, last_sync: Any = None) -> Any:
        """0 for no average, else the 1-based level of the largest dividing period."""
        del last_sync
        if _is_traced(step):
            step = jnp.asarray(step)
            level = jnp.zeros_like(step, dtype=jnp.int32)
            for k, p in enumerate(self.periods, start=1):
                level = jnp.where(step % p == 0, k, level)  # the largest period wins
            return jnp.where(step >= self.warmup_steps, level, 0)
        if step < self.warmup_steps:
            return 0
        return max((k for k, p in enumerate(self.periods, 1) if step % p == 0), default=0)


@dataclasses.dataclass(frozen=True)
class AdaptiveSchedule(Schedule):
    """A period that changes with the step: average at ``s >= warmup_steps`` when ``s ==
    warmup_steps`` or ``s - last_average >= period(s)``.

    AdaComm-style (Wang & Joshi, SysML 2019). For a constant period this is the
    periodic rule. The level depends on the step of the last average, which the
    averager's state keeps (``last_sync``).

    The step counters are int32: a period of ``2**31 - 1`` or more never comes due (a
    Python int beyond int32 is read as ``2**31 - 1``), and the counter cannot go past
    ``2**31 - 1`` calls, as the schedule has no cycle to continue from: the call there
    raises OverflowError, on the device and in every replay (``check_calls``).

    Attributes:
      period: a jit-able ``period(step) -> int``.
      warmup_steps: steps before the first average.

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax.schedules._schedule import AdaptiveSchedule
      >>> AdaptiveSchedule(lambda s: jnp.where(s < 4, 2, 3)).replay(10).tolist()
      [1, 0, 1, 0, 0, 1, 0, 0, 1, 0]
    """

    period: Callable[[Any], Any]
    warmup_steps: int = 0
    tracks_last_sync = True

    def __post_init__(self) -> None:
        if not callable(self.period):
            raise TypeError(f"period must be callable here, got {self.period!r}.")
        warmup = _validate.nonnegative_int(self.warmup_steps, "warmup_steps")
        object.__setattr__(self, "warmup_steps", warmup)

    @property
    def num_levels(self) -> int:
        return 1

    @property
    def cycle(self) -> None:
        return None

    def _period_at(self, step: Any) -> Any:
        """``period(step)`` as the int32 counters compare it: a Python or NumPy int at or
        beyond the int32 maximum reads as the maximum (the same rule for every call a
        counter reaches: ``step - last_sync`` never exceeds it before the counter's end)."""
        try:
            period = self.period(step)
        except OverflowError as e:
            try:
                at = f"step {int(step)}"
            except jax.errors.ConcretizationTypeError:
                at = "a traced step"
            raise OverflowError(
                f"period={_period_name(self.period)} raised OverflowError at {at}: {e}. "
                "The step counters are int32, so a period is compared as one; "
                f"return at most 2**31 - 1 ({INT32_MAX}), which already means no average "
                "again before the counter's end."
            ) from e
        if isinstance(period, (int, np.integer)) and period > INT32_MAX:
            return INT32_MAX
        return period

    def is_global(self, level: int) -> bool:
        return level > 0

    def first_global_step(self, fragment: int = 0) -> int:
        return self.warmup_steps

    def level(self, step: Any, last_sync: Any = None) -> Any:
        """1 when ``step`` averages given the step of the last average, else 0."""
        if last_sync is None:
            raise TypeError(
                "With a period schedule the level depends on the last average, not on the "
                "step alone: use averager.schedule(num_steps)."
            )
        if _is_traced(step, last_sync):
            period = jnp.asarray(self._period_at(step), jnp.int32)
            on = (step == self.warmup_steps) | (step - last_sync >= period)
            return ((step >= self.warmup_steps) & on).astype(jnp.int32)
        if step > INT32_MAX:  # no int32 counter holds it (nor can period(step) see it)
            raise OverflowError(
                f"{type(self).__name__}.level({step}): " + self.overflow_message("this schedule")
            )
        host_period = int(self._period_at(jnp.int32(step)))
        hit = step >= self.warmup_steps and (
            step == self.warmup_steps or step - last_sync >= host_period
        )
        return int(hit)


_Schedule = Schedule  # its name before it was public


@functools.lru_cache(maxsize=256)
def _first_global(schedule: Schedule) -> int:
    """:meth:`Schedule.first_global_step`'s host replay (cached: schedules are frozen)."""
    last = 0
    start = schedule.warmup_steps
    for s in range(start, start + (schedule.cycle or 10_000)):
        level = schedule.host_level(s, last)
        if level and schedule.is_global(level):
            return s
        last = s if level else last
    return start
