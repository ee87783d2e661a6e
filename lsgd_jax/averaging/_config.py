"""An averager's configuration: its options, checked and compared by value, and the
parts they build (when, what, how, then).
"""

from __future__ import annotations

import abc
import dataclasses
import logging
from typing import Any, cast

import numpy as np
import optax

from lsgd_jax import comm
from lsgd_jax._core import _validate
from lsgd_jax._core._collectives import Group, GroupSpec
from lsgd_jax.averaging import _outer
from lsgd_jax.averaging._diloco import DilocoOuter
from lsgd_jax.schedules import AdaptiveSchedule, HierarchicalSchedule, PeriodicSchedule, Schedule

# an averager's nonfinite=: PyTorch's behaviour, or a comm.finite_only policy
NONFINITE_POLICIES = ("propagate", *comm.NONFINITE_POLICIES)

logger = logging.getLogger("lsgd_jax")

_OPTIONS_DOC = """
      nonfinite: what a replica with NaN/Inf params does to an average:
        ``"propagate"`` (PyTorch: the element becomes NaN), ``"exclude"`` (the finite
        replicas' mean, which the others receive) or ``"skip"`` (the group does not
        average this time).
      outer_optimizer: an optax transformation applied at each global average to
        ``anchor - mean(params)`` (SlowMo, DiLoCo); ``optax.sgd(1.0)`` is plain averaging.
      outer_skip_first: the first global average sets the anchor and the outer step acts
        from the second on (default); False: the anchor is ``init``'s params.
      communication_dtype: e.g. ``jnp.bfloat16``: send the average in it, sum in float32.
      delta: average ``params - anchor``, added back to the anchor.
      delay: ``tau``: a global average lands ``tau`` calls after it starts, as ``params +
        (mean - s)`` (Overlap Local-SGD); ``1 <= tau <`` the period.
      communication: a ``lsgd_jax.comm`` strategy, instead of ``nonfinite`` and
        ``communication_dtype``.
      offload_state: True: the averager's buffers live in host memory between averages.
        Each option in depth: docs/options_in_depth.md, "The averagers' options".
"""


def _normalized(group: GroupSpec) -> Group | None:
    """An averager's ``process_group`` as ``__post_init__`` stores it (normalized)."""
    return cast("Group | None", group)


def _communicator(averager: Any) -> comm.Communication:
    """The strategy an averager's options ask for (``communication=`` or the flags)."""
    if averager.communication is not None:
        if not isinstance(averager.communication, comm.Communication):
            raise TypeError(
                f"communication must be a lsgd_jax.comm strategy (e.g. "
                f"lsgd_jax.comm.flat()), got {averager.communication!r}."
            )
        if averager.nonfinite != "propagate" or averager.communication_dtype is not None:
            raise ValueError(
                "Give either communication= or nonfinite=/communication_dtype=, not both: "
                f"communication={averager.communication!r}, nonfinite="
                f"{averager.nonfinite!r}, communication_dtype={averager.communication_dtype!r}."
            )
        return averager.communication
    if averager.communication_dtype is not None:
        if averager.nonfinite != "propagate":
            raise ValueError(
                "communication_dtype works with nonfinite='propagate' only; the "
                f"finiteness check needs the exact all-reduce (got {averager.nonfinite!r})."
            )
        return comm.compressed(averager.communication_dtype)
    if averager.nonfinite != "propagate":
        return comm.finite_only(averager.nonfinite)
    return comm.flat()


def _check_options(self: Any) -> None:
    """Validates (and normalizes) the options both averagers share."""
    _validate.one_of(
        self.nonfinite,
        "nonfinite",
        NONFINITE_POLICIES,
        ": 'propagate' (PyTorch's behaviour: a NaN spreads to the whole group), 'exclude' "
        "(average the finite replicas only) or 'skip' (no average for a group with a NaN)",
    )
    if self.outer_optimizer is not None and not isinstance(
        self.outer_optimizer, optax.GradientTransformation
    ):
        raise TypeError(
            f"outer_optimizer must be an optax GradientTransformation, got "
            f"{self.outer_optimizer!r}; e.g. optax.sgd(0.7, momentum=0.9, nesterov=True)."
        )
    for flag in ("delta", "outer_skip_first"):
        object.__setattr__(self, flag, _validate.boolean(getattr(self, flag), flag))
    _check_outer_skip_first(self.outer_optimizer, self.outer_skip_first)
    object.__setattr__(self, "delay", _validate.nonnegative_int(self.delay, "delay"))
    if self.offload_state is not None:  # None and False alike: on the device
        offload = _validate.boolean(self.offload_state, "offload_state")
        object.__setattr__(self, "offload_state", True if offload else None)
    if self.communication_dtype is not None:
        dtype = comm.compressed(self.communication_dtype).dtype
        object.__setattr__(self, "communication_dtype", dtype)
    _communicator(self)


def _check_outer_skip_first(outer: Any, skip_first: bool) -> None:
    """Refuses a ``diloco_outer`` built for another ``outer_skip_first``: its cool-down
    counts the updates that value gives, so the run's last update would not be the
    plain average."""
    if not isinstance(outer, DilocoOuter) or outer.outer_skip_first == skip_first:
        return
    updates = "one more" if skip_first else "one fewer"
    raise ValueError(
        f"outer_skip_first={skip_first} here, but the outer_optimizer was built with "
        f"diloco_outer(..., outer_skip_first={outer.outer_skip_first}): its cool-down "
        f"counts {updates} outer update than this averager gives it, so the run's last "
        f"update would not be the plain average. Pass the same value to both, e.g. "
        f"diloco_outer(..., outer_skip_first={skip_first})."
    )


class _AveragerConfig(abc.ABC):
    """An averager's configuration: its parts, groups and schedule, compared by value.

    A subclass gives the schedule (``sync_schedule``), the groups, and how each level
    resolves to a group (and fragment) where it runs.
    """

    warmup_steps: int
    nonfinite: str
    outer_optimizer: Any
    outer_skip_first: bool
    communication_dtype: Any
    delta: bool
    communication: Any
    delay: int
    offload_state: bool | None
    process_group: GroupSpec

    @property
    @abc.abstractmethod
    def sync_schedule(self) -> Any:
        """When to average (a PeriodicSchedule, HierarchicalSchedule or AdaptiveSchedule)."""

    @property
    @abc.abstractmethod
    def groups(self) -> tuple[Group | None, ...]:
        """The group of each level (None for every bound mapped axis)."""

    @abc.abstractmethod
    def _branch_groups(self) -> list[tuple[Group, Any, bool]]:
        """One ``(resolved group, fragment or None, is_global)`` per level, where it runs."""

    @abc.abstractmethod
    def _first_global_step(self, fragment: int) -> int:
        """The step of the first global average of fragment ``fragment`` (0-based; 0
        without fragments): until then the replicas' anchors may differ."""

    @property
    def communicator(self) -> comm.Communication:
        """The communication strategy of the averages (from ``communication`` or the
        ``nonfinite`` / ``communication_dtype`` options).

        Example:
          >>> import lsgd_jax
          >>> lsgd_jax.PeriodicModelAverager(4, nonfinite="skip").communicator
          FiniteOnly(policy='skip')
        """
        return _communicator(self)

    @property
    def parts(self) -> _outer.Parts:
        """The averager as four parts: when (the schedule), what (the params or their
        change since the anchor), how (the communication strategy) and then (assign the
        mean, or an outer optimizer's step). The options build them; one average runs
        them in that order (``_average_call.average_level``).

        Example:
          >>> import lsgd_jax
          >>> parts = lsgd_jax.PeriodicModelAverager(4, delta=True).parts
          >>> parts.what, parts.how, parts.then
          (SendDelta(), Flat(), Assign())
        """
        what = _outer.SendDelta() if self.delta else _outer.SendParams()
        then: _outer.Assign | _outer.OuterStep = _outer.Assign()
        if self.outer_optimizer is not None:
            then = _outer.OuterStep(self.outer_optimizer, self.outer_skip_first)
        return _outer.Parts(self.sync_schedule, what, self.communicator, then)

    def _identity(self) -> tuple:
        """What equality compares: the class, the fields that are not spellings of the
        communication strategy, and the strategy they resolve to (so ``nonfinite="skip"``
        equals ``communication=comm.finite_only("skip")``)."""
        spellings = ("nonfinite", "communication_dtype", "communication")
        fields = [f.name for f in dataclasses.fields(self)]  # type: ignore[arg-type]
        kept = tuple((n, getattr(self, n)) for n in fields if n not in spellings)
        return type(self), kept, self.communicator

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _AveragerConfig) and self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    @property
    def needs_params(self) -> bool:
        """Whether ``init`` needs the params (outer optimizer, delta, delay)."""
        return self.parts.needs_anchor or bool(self.delay)

    @property
    def num_levels(self) -> int:
        """How many nonzero levels ``level`` / ``schedule`` can return (one per group,
        or per fragment)."""
        return self.sync_schedule.num_levels

    def is_global(self, level: int) -> bool:
        """Whether an average at ``level`` (0: none) spans the global group: the last
        group's level, or every fragment's.

        Example:
          >>> import lsgd_jax
          >>> avg = lsgd_jax.HierarchicalModelAverager({2: "local", 8: ("node", "local")})
          >>> [avg.is_global(k) for k in range(3)]
          [False, False, True]
        """
        return self.sync_schedule.is_global(level)

    @property
    def cycle(self) -> int | None:
        """The schedule's cycle after the warm-up: the period (periodic), the least common
        multiple of the periods (hierarchical), None for a callable period."""
        return self.sync_schedule.cycle

    def schedule(self, num_steps: int) -> np.ndarray:
        """The level of every call from step 0 to ``num_steps - 1`` (0: no average), for
        every option (a callable period included): the way to count averages, e.g.
        ``sum(map(avg.is_global, avg.schedule(1000)))`` global ones.

        Example:
          >>> import lsgd_jax
          >>> lsgd_jax.PeriodicModelAverager(3, warmup_steps=1).schedule(8).tolist()
          [0, 1, 0, 0, 1, 0, 0, 1]
        """
        return self.sync_schedule.replay(num_steps)


def _options() -> dict[str, Any]:
    return {
        "nonfinite": dataclasses.field(default="propagate", kw_only=True),
        "outer_optimizer": dataclasses.field(default=None, kw_only=True),
        "outer_skip_first": dataclasses.field(default=True, kw_only=True),
        "communication_dtype": dataclasses.field(default=None, kw_only=True),
        "delta": dataclasses.field(default=False, kw_only=True),
        "communication": dataclasses.field(default=None, kw_only=True),
        "delay": dataclasses.field(default=0, kw_only=True),
        "offload_state": dataclasses.field(default=None, kw_only=True),
    }


def given_schedule(averager: Any, schedule: Schedule) -> Schedule | None:
    """A schedule passed as ``period``: its warm-up, fragments and delay become the
    averager's (which must be left at their defaults or agree). A PeriodicSchedule or an
    AdaptiveSchedule becomes its int or callable period (None: the averager then builds
    the same schedule); any other schedule is checked and returned to be used as it is."""
    name = f"PeriodicModelAverager(period={schedule!r})"
    if isinstance(schedule, HierarchicalSchedule):
        raise TypeError(
            f"{name}: a HierarchicalSchedule has one group per level; use "
            "HierarchicalModelAverager (or lsgd_jax.averaging.from_parts with one group "
            "per period)."
        )
    frozen = dataclasses.is_dataclass(schedule) and type(schedule).__dataclass_params__.frozen
    if not frozen:
        raise TypeError(
            f"{name}: a schedule is a frozen dataclass (@dataclasses.dataclass(frozen=True) "
            "on its class), so that averagers built from equal schedules are equal and "
            "hash alike."
        )
    if isinstance(schedule, AdaptiveSchedule):  # delay and fragments: the callable's rule
        own = {"warmup_steps": schedule.warmup_steps}
    else:
        fields = {f.name for f in dataclasses.fields(schedule)}  # type: ignore[arg-type]
        own = {
            n: getattr(schedule, n) for n in ("warmup_steps", "fragments", "delay") if n in fields
        }
    for field, value in own.items():
        given = getattr(averager, field)
        if given not in (value, {"fragments": 1}.get(field, 0)):
            raise ValueError(
                f"PeriodicModelAverager: period={schedule!r} has {field}={value}, but "
                f"{field}={given} was given too: set it in the schedule alone."
            )
        object.__setattr__(averager, field, value)
    if isinstance(schedule, (PeriodicSchedule, AdaptiveSchedule)):
        object.__setattr__(averager, "period", schedule.period)
        return None
    for field in ("fragments", "delay"):
        if field not in own and getattr(averager, field) != {"fragments": 1}.get(field, 0):
            raise ValueError(
                f"{name}: {field}={getattr(averager, field)} belongs to the schedule; give "
                f"{type(schedule).__name__} a field `{field}: int` instead."
            )
    object.__setattr__(averager, "warmup_steps", schedule.warmup_steps)
    _check_own_schedule(name, schedule)
    return schedule


def _check_own_schedule(name: str, schedule: Schedule) -> None:
    """A user's schedule: one level, a rule that reads only what it declares, and at most
    one delayed average in flight (checked by a host replay of its first steps)."""
    if schedule.num_levels != 1:
        raise ValueError(
            f"{name}: the schedule has {schedule.num_levels} levels, but this averager has "
            "one group; give the schedule num_levels = 1."
        )
    if not schedule.tracks_last_sync:
        try:
            schedule.host_level(schedule.warmup_steps)
        except TypeError as e:
            raise TypeError(
                f"{name}: its level(step, last_sync) failed with last_sync=None ({e}). A rule "
                "that reads the step of the last average says so: set tracks_last_sync = "
                "True on the class (the averager's state then keeps that step)."
            ) from e
    if schedule.delay:
        if schedule.tracks_last_sync:
            raise ValueError(
                f"{name}: delay={schedule.delay} needs a rule of the step alone (a delayed "
                "average's landing is found from the step it started at); drop the delay or "
                "tracks_last_sync."
            )
        span = min(schedule.cycle or 1024, 4096) + schedule.delay
        started = np.flatnonzero(schedule.replay(schedule.warmup_steps + span))
        close = np.flatnonzero(np.diff(started) <= schedule.delay)
        if close.size:
            a, b = started[close[0]], started[close[0] + 1]
            raise ValueError(
                f"{name}: averages start at steps {a} and {b}, closer than delay="
                f"{schedule.delay} + 1: one delayed average is in flight at a time; space the "
                "averages further apart or lower the delay."
            )
