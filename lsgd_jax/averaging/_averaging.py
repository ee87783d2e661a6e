"""Model averagers: PeriodicModelAverager and HierarchicalModelAverager.

An averager is an immutable, hashable config: a schedule (when to average,
``_schedule``), groups (over whom), a communication strategy (how the mean travels,
``lsgd_jax.comm``) and options for the maths around a global mean (``_outer``). Its
mutable part is a :class:`ModelAveragerState`. One call (``_average_call``) takes one
branch from the state's counters, the same on every replica, so at most one group's
collective runs per step.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union, cast

import jax

from lsgd_jax._core import _collectives, _validate
from lsgd_jax._core._collectives import Group, GroupSpec
from lsgd_jax.averaging import _average_call, _fragments
from lsgd_jax.averaging._averager_state import ModelAveragerState, check_state, initial_state
from lsgd_jax.averaging._config import (
    _OPTIONS_DOC,
    _AveragerConfig,
    _check_options,
    _normalized,
    _options,
    given_schedule,
    logger,
)
from lsgd_jax.schedules import AdaptiveSchedule, HierarchicalSchedule, PeriodicSchedule, Schedule

_PERIOD_ONE = (
    "When period is 1, no need to use model averaging because the communication cost of "
    "all-reducing parameters will be no less than the cost of all-reducing gradients in "
    "the backward pass. Therefore, only plain data-parallel averaging of gradients should "
    "be used for this case."
)


class _Averager(_AveragerConfig):
    """What both averagers share: the configuration, the state, and the public calls."""

    def init(self, params: Any = None) -> ModelAveragerState:
        """Returns the initial state: ``step == 0`` (and the anchor, where needed).

        Args:
          params: the initial params; required with ``outer_optimizer`` or ``delta``
            (the anchor of the first global average), ignored otherwise.

        Returns:
          A ModelAveragerState.

        Example:
          >>> import lsgd_jax
          >>> int(lsgd_jax.PeriodicModelAverager(4).init().step)
          0
        """
        return initial_state(self, params)

    def _advance(self, state: ModelAveragerState) -> ModelAveragerState:
        """The state after one more call (see ``_schedule._Schedule.next_step``)."""
        return state.replace(step=self.sync_schedule.next_step(state.step, type(self).__name__))

    def average_alongside(self, tree: Any, state: ModelAveragerState) -> Any:
        """The plain group mean of ``tree`` on the steps (and groups) that ``state`` averages.

        For values that follow the params but are not part of them, such as batch-norm
        statistics: call it with the averager state of the same step (before it was
        advanced). No anchor, outer optimizer or fragments apply; the step is not advanced.

        Args:
          tree: the pytree to average.
          state: the averager's state at this step.

        Returns:
          The averaged (or unchanged) tree.

        Example:
          >>> import jax, jax.numpy as jnp, lsgd_jax
          >>> from jax.sharding import PartitionSpec as P
          >>> mesh = lsgd_jax.make_mesh(num_nodes=2, devices_per_node=2)
          >>> avg = lsgd_jax.PeriodicModelAverager(period=2)
          >>> f = jax.jit(jax.shard_map(avg.average_alongside, mesh=mesh,
          ...     in_specs=(P(("node", "local")), P()), out_specs=P(("node", "local"))))
          >>> f(jnp.arange(4.0), avg.init())
          Array([1.5, 1.5, 1.5, 1.5], dtype=float32)
        """
        return _average_call.alongside(self, tree, state)

    def average_parameters(
        self, params: Any, state: ModelAveragerState
    ) -> tuple[Any, ModelAveragerState]:
        """Replaces ``params`` by their group mean on averaging steps; advances the step.

        The exact path: on an averaging step each replica's params become the group mean
        itself, so the replicas of a group are bitwise identical afterwards. Call it after
        ``optax.apply_updates``, inside ``jax.shard_map`` or ``jax.pmap``.

        Args:
          params: this replica's parameters (any pytree; only floating leaves average).
          state: the averager's state, from ``init()``; the same on every replica.

        Returns:
          ``(params, new_state)``.

        Example:
          >>> import jax, jax.numpy as jnp, lsgd_jax
          >>> from jax.sharding import PartitionSpec as P
          >>> mesh = lsgd_jax.make_mesh(num_nodes=2, devices_per_node=2)
          >>> avg = lsgd_jax.PeriodicModelAverager(period=2)
          >>> f = jax.jit(jax.shard_map(avg.average_parameters, mesh=mesh,
          ...     in_specs=(P(("node", "local")), P()), out_specs=(P(("node", "local")), P())))
          >>> p, s = f(jnp.arange(4.0), avg.init())   # step 0 averages
          >>> p, int(s.step)
          (Array([1.5, 1.5, 1.5, 1.5], dtype=float32), 1)
        """
        return self.average_tree(params, None, state)[::2]

    def average_tree(
        self, params: Any, extra: Any, state: ModelAveragerState
    ) -> tuple[Any, Any, ModelAveragerState]:
        """Like ``average_parameters``, also averaging ``extra`` in the same collective.

        ``extra`` (e.g. momentum buffers, batch-norm statistics) is averaged on the same
        steps, over the same group, with the same all-reduce as the params, but takes no
        part in the options that concern the model (anchor, outer optimizer, delta).
        Not with a quantized communication (``comm.quantized``: ValueError), which would
        round ``extra`` in blocks with no error feedback of its own.

        Args:
          params: this replica's parameters.
          extra: any pytree to average alongside (None for nothing).
          state: the averager's state.

        Returns:
          ``(params, extra, new_state)``.

        Example:
          >>> import jax, jax.numpy as jnp, lsgd_jax
          >>> from jax.sharding import PartitionSpec as P
          >>> mesh = lsgd_jax.make_mesh(num_nodes=2, devices_per_node=2)
          >>> avg = lsgd_jax.PeriodicModelAverager(period=2)
          >>> D = P(("node", "local"))
          >>> f = jax.jit(jax.shard_map(avg.average_tree, mesh=mesh,
          ...     in_specs=(D, D, P()), out_specs=(D, D, P())))
          >>> p, m, s = f(jnp.arange(4.0), 10 * jnp.arange(4.0), avg.init())
          >>> m
          Array([15., 15., 15., 15.], dtype=float32)
        """
        check_state(state, "average_parameters", self)
        if self.communicator.rounds_small_values and extra is not None:
            raise ValueError(
                f"average_tree: extra values cannot travel with a quantized communication "
                f"({self.communicator!r}): they would be rounded in blocks scaled by each "
                "block's largest value, with no error feedback of their own, so small "
                "entries (Adam's second moments, running variances) round to 0. Average "
                "them with an exact or bfloat16 strategy (lsgd_jax.comm.apply(lsgd_jax."
                "comm.flat(), extra, group)), or use communication=lsgd_jax.comm.flat()."
            )
        if self.delay and extra is not None:
            raise ValueError(
                f"average_tree: extra values are not averaged by a delayed average (delay="
                f"{self.delay}); average them with average_alongside, or use delay=0."
            )
        (params, extra), state = _average_call.run(
            self,
            (params, extra),
            state,
            prepare=lambda op: op,
            finish=lambda op, p, e: (p, e),
            passthrough=lambda op: op,
        )
        return params, extra, self._advance(state)


@dataclasses.dataclass(frozen=True, eq=False)  # equality: _Averager._identity
class PeriodicModelAverager(_Averager):
    """Averages the model over a group every ``period`` steps after a warm-up.

    The JAX form of PyTorch's ``PeriodicModelAverager``: the call at step ``s`` (from 0)
    averages when ``s >= warmup_steps`` and ``(s - warmup_steps) % period == 0``. With
    :func:`post_local_sgd`, set ``warmup_steps == start_localSGD_iter``.

    An immutable, hashable config (the step counter lives in the state from ``init()``);
    every option is off by default, which is PyTorch's behaviour exactly.

    Args:
      period: steps between averages (>= 1; 1 warns: DDP is then cheaper); or a jit-able
        ``period(step) -> int``, averaging when ``s - last_average >= period(s)``
        (AdaComm); or a ``lsgd_jax.schedules.Schedule`` (your own rule, with its warm-up).
      warmup_steps: steps before the first average (>= 0).
      process_group: the axes to average over (None: every mapped axis bound there).
      fragments: average one of this many equal slices of the params at a time, round
        robin, the k-th offset by ``k * period / fragments`` steps (Streaming DiLoCo);
        ``period`` divisible by it; not with an ``outer_optimizer``.{options}
    Example:
      >>> import lsgd_jax
      >>> avg = lsgd_jax.PeriodicModelAverager(period=4, warmup_steps=2)
      >>> [s for s in range(12) if avg.level(s)]
      [2, 6, 10]

    References:
      Lin, Stich, Patel, Jaggi, `Don't Use Large Mini-Batches, Use Local SGD
      <https://arxiv.org/abs/1808.07217>`_, ICLR 2020.
    """

    period: int | Callable[[jax.Array], Any] | Schedule
    warmup_steps: int = 0
    process_group: GroupSpec = None
    fragments: int = dataclasses.field(default=1, kw_only=True)
    nonfinite: str = _options()["nonfinite"]
    outer_optimizer: Any = _options()["outer_optimizer"]
    outer_skip_first: bool = _options()["outer_skip_first"]
    communication_dtype: Any = _options()["communication_dtype"]
    delta: bool = _options()["delta"]
    communication: Any = _options()["communication"]
    delay: int = _options()["delay"]
    offload_state: bool | None = _options()["offload_state"]

    def __post_init__(self) -> None:
        if isinstance(self.period, type) and issubclass(self.period, Schedule):
            raise TypeError(
                f"period={self.period.__name__} is a schedule class: pass an instance, "
                f"period={self.period.__name__}()."
            )
        given = given_schedule(self, self.period) if isinstance(self.period, Schedule) else None
        _check_options(self)
        warmup = _validate.nonnegative_int(self.warmup_steps, "warmup_steps")
        object.__setattr__(self, "warmup_steps", warmup)
        k = _validate.positive_int(self.fragments, "fragments")
        object.__setattr__(self, "fragments", k)
        schedule: Any
        if given is not None:
            schedule = given
        elif callable(self.period):
            if k > 1 or self.delay:
                raise ValueError(
                    f"fragments={k} and delay={self.delay} need an int period (a callable "
                    f"period has no fixed spacing), got period={self.period!r}; e.g. "
                    f"period={4 * k}."
                )
            schedule = AdaptiveSchedule(self.period, warmup)
        else:
            schedule = PeriodicSchedule(cast(int, self.period), warmup, k, self.delay)
            object.__setattr__(self, "period", schedule.period)
            if schedule.period == 1:
                warnings.warn(_PERIOD_ONE, stacklevel=3)
        object.__setattr__(self, "_schedule", schedule)
        group = _collectives.normalize_group(self.process_group, "process_group")
        object.__setattr__(self, "process_group", group)
        if k > 1 and self.outer_optimizer is not None:
            raise ValueError(
                f"fragments={k} with an outer_optimizer is not supported (Streaming "
                "DiLoCo's per-fragment outer step is not implemented): use fragments="
                f"{k} with a plain average (outer_optimizer=None), or the outer_optimizer "
                "on the whole model (fragments=1)."
            )

    @property
    def sync_schedule(self) -> Schedule:
        """The schedule (a PeriodicSchedule for an int period, an AdaptiveSchedule for a
        callable, or the schedule given as ``period``).

        Example:
          >>> import lsgd_jax
          >>> lsgd_jax.PeriodicModelAverager(4, warmup_steps=2).sync_schedule
          PeriodicSchedule(period=4, warmup_steps=2, fragments=1, delay=0)
        """
        return self._schedule  # type: ignore[attr-defined]

    @property
    def groups(self) -> tuple[Group | None, ...]:
        return (_normalized(self.process_group),)

    def level(self, step: Any) -> Any:
        """Which call averages: 0 for none, else 1 (or the fragment number, 1-based).

        Args:
          step: the averager's step count (Python int or int array).

        Returns:
          The level, of the same kind as ``step``.

        Example:
          >>> import lsgd_jax
          >>> [lsgd_jax.PeriodicModelAverager(2, warmup_steps=1).level(s) for s in range(5)]
          [0, 1, 0, 1, 0]
          >>> [lsgd_jax.PeriodicModelAverager(4, fragments=2).level(s) for s in range(6)]
          [1, 0, 2, 0, 1, 0]
        """
        return self.sync_schedule.level(step)

    def _first_global_step(self, fragment: int) -> int:
        """The step of the first average of fragment ``fragment`` (0-based)."""
        return self.sync_schedule.first_global_step(fragment)

    def _branch_groups(self) -> list[tuple[Group, Any, bool]]:
        what = "PeriodicModelAverager"
        group = _collectives.resolve(
            _normalized(self.process_group), _collectives.global_axes(what), what
        )
        if self.fragments == 1:
            return [(group, None, True)]
        return [
            (group, _fragments.Fragment(k, self.fragments), True) for k in range(self.fragments)
        ]


PeriodicModelAverager.__doc__ = (PeriodicModelAverager.__doc__ or "").format(options=_OPTIONS_DOC)


@dataclasses.dataclass(frozen=True, eq=False)  # equality: _Averager._identity
class HierarchicalModelAverager(_Averager):
    """Averages over nested groups, each at its own period (e.g. node, pod, world).

    The JAX form of PyTorch's ``HierarchicalModelAverager``: a call at step ``s`` with
    ``s >= warmup_steps`` takes the LARGEST period with ``s % period == 0`` (``s``, not
    ``s - warmup_steps``, unlike the periodic averager) and averages over that period's
    group only. At most one group's collective runs per step (one ``lax.switch``).

    Args:
      period_group_dict: maps each period to its group's mesh axes (an axis name, a tuple
        of names, or an IndexGroups), smallest period and group first; groups nested;
        the last one the global axes (or None for every bound mapped axis).
      warmup_steps: steps before the first average (>= 0).
      process_group: the global axes, to check the last group against at construction;
        None: checked where it runs, against every bound mapped axis.
      nonfinite, outer_optimizer, communication_dtype, delta, communication, delay: as
        for PeriodicModelAverager; the outer optimizer and the delay act at the global
        (last) level, and the anchor is the params at the last global average (``delta``
        averages the change since it at every level).

    Example:
      >>> import lsgd_jax
      >>> avg = lsgd_jax.HierarchicalModelAverager(
      ...     {2: "local", 4: ("node", "local")}, warmup_steps=2)
      >>> [avg.level(s) for s in range(9)]
      [0, 0, 1, 0, 2, 0, 1, 0, 2]
    """

    period_group_dict: Mapping[int, GroupSpec]
    warmup_steps: int = 0
    process_group: GroupSpec = None
    nonfinite: str = _options()["nonfinite"]
    outer_optimizer: Any = _options()["outer_optimizer"]
    outer_skip_first: bool = _options()["outer_skip_first"]
    communication_dtype: Any = _options()["communication_dtype"]
    delta: bool = _options()["delta"]
    communication: Any = _options()["communication"]
    delay: int = _options()["delay"]
    offload_state: bool | None = _options()["offload_state"]

    def __post_init__(self) -> None:
        _check_options(self)
        d = self.period_group_dict
        if not isinstance(d, Mapping) or not d:
            raise ValueError(
                f"period_group_dict must be a non-empty dict of period -> group axes, got "
                f"{d!r}; e.g. {{4: 'local', 16: ('node', 'local')}}."
            )
        periods = [_validate.positive_int(p, f"period {p!r} in period_group_dict") for p in d]
        if any(b <= a for a, b in zip(periods, periods[1:])):
            raise ValueError(
                f"The periods of period_group_dict must be strictly increasing (smallest "
                f"group first), got {periods}; order the dict by period."
            )
        groups = [_collectives.normalize_group(g, f"group of period {p}") for p, g in d.items()]
        if None in groups[:-1]:
            raise ValueError(
                "Only the last (global) group of period_group_dict may be None; name the "
                f"axes of the others, got {dict(zip(periods, groups))}."
            )
        warmup = _validate.nonnegative_int(self.warmup_steps, "warmup_steps")
        object.__setattr__(self, "warmup_steps", warmup)
        schedule = HierarchicalSchedule(tuple(periods), warmup, self.delay)
        object.__setattr__(self, "_schedule", schedule)
        object.__setattr__(self, "period_group_dict", tuple(zip(periods, groups)))
        pg = _collectives.normalize_group(self.process_group, "process_group")
        object.__setattr__(self, "process_group", pg)
        self._check_groups(groups, pg)
        if periods[-1] == 1:
            warnings.warn(_PERIOD_ONE, stacklevel=3)
        logger.info("Model averaging hierarchy:")
        for p, g in zip(periods, groups):
            logger.info(
                "\tEach group over axes %s averages parameters every %s iterations, if no "
                "higher-level averaging.",
                g if g is not None else "(all)",
                p,
            )

    @staticmethod
    def _check_groups(groups: Sequence[Group | None], global_group: Group | None) -> None:
        for small, big in zip(groups, groups[1:]):
            if small is not None and big is not None and not _collectives.group_covers(small, big):
                raise ValueError(
                    f"The groups of period_group_dict must be nested (each inside the next), "
                    f"but {small!r} is not inside {big!r}."
                )
        last = groups[-1]
        covers = _collectives.group_covers
        if global_group is not None and last is not None:
            if not (covers(last, global_group) and covers(global_group, last)):  # same group
                raise ValueError(
                    f"The last group of period_group_dict must be the global group "
                    f"{global_group!r}, got {last!r}; add a level for the global axes (when "
                    "the shard_map is also manual over a model axis, pass "
                    "process_group=<the data axes>)."
                )

    @property
    def sync_schedule(self) -> HierarchicalSchedule:
        """The schedule, a HierarchicalSchedule of the periods.

        Example:
          >>> import lsgd_jax
          >>> lsgd_jax.HierarchicalModelAverager({2: "local", 8: ("node", "local")}).cycle
          8
        """
        return self._schedule  # type: ignore[attr-defined]

    @property
    def periods(self) -> tuple[int, ...]:
        """The periods, in increasing order."""
        return tuple(p for p, _ in self._levels)

    @property
    def groups(self) -> tuple[Group | None, ...]:
        return tuple(g for _, g in self._levels)

    @property
    def _levels(self) -> tuple[tuple[int, Group | None], ...]:
        """``period_group_dict`` as ``__post_init__`` stores it: (period, group) pairs."""
        return cast(tuple[tuple[int, Group | None], ...], self.period_group_dict)

    def level(self, step: Any) -> Any:
        """Which group a call at ``step`` averages: 0 for none, k for the k-th (1-based).

        Args:
          step: the averager's step count (int or int array).

        Returns:
          The level, of the same kind as ``step``.

        Example:
          >>> import lsgd_jax
          >>> avg = lsgd_jax.HierarchicalModelAverager({1: "local", 3: ("node", "local")})
          >>> [avg.level(s) for s in range(4)]
          [2, 1, 1, 2]
        """
        return self.sync_schedule.level(step)

    def _first_global_step(self, fragment: int) -> int:
        """The step of the first global average (``fragment`` is 0)."""
        return self.sync_schedule.first_global_step(fragment)

    def _branch_groups(self) -> list[tuple[Group, Any, bool]]:
        what = "HierarchicalModelAverager"
        default = _collectives.global_axes(what)
        global_group = _collectives.resolve(
            _normalized(self.process_group), default, what + " (process_group)"
        )
        groups = [_collectives.resolve(g, lambda: global_group, what) for g in self.groups]
        self._check_groups(groups, global_group)
        return [(g, None, k == len(groups) - 1) for k, g in enumerate(groups)]


Averager = Union[PeriodicModelAverager, HierarchicalModelAverager]


def check_averager(averager: Any, what: str) -> None:
    """Raises TypeError unless ``averager`` is one of ours."""
    if not isinstance(averager, _Averager):
        raise TypeError(
            f"{what} expects a PeriodicModelAverager or HierarchicalModelAverager, got "
            f"{averager!r}."
        )
