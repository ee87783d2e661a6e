"""An averager from its parts: the configuration as one value, read and built.

Every averager is four parts (``averager.parts``): *when* (a schedule value from
``lsgd_jax.schedules``), *what* travels (the params, or their change since the anchor),
*how* (a ``lsgd_jax.comm`` strategy) and *then* (assign the mean, or an outer optimizer's
step). The PyTorch-named constructors and their keywords build the parts;
:func:`from_parts` builds the averager back from them, so a configuration can be passed
around, compared and changed as one value (``parts._replace(how=...)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lsgd_jax._core._collectives import GroupSpec
from lsgd_jax.averaging._averaging import HierarchicalModelAverager, PeriodicModelAverager
from lsgd_jax.averaging._outer import Assign, OuterStep, Parts, SendDelta, SendParams
from lsgd_jax.schedules import HierarchicalSchedule, Schedule


def _options(parts: Parts) -> dict[str, Any]:
    """The keywords that spell ``parts.what``, ``parts.how`` and ``parts.then``."""
    if not isinstance(parts, Parts):
        raise TypeError(
            f"from_parts expects an averager's Parts (averager.parts, or "
            f"lsgd_jax.averaging.Parts(when, what, how, then)), got {parts!r}."
        )
    if not isinstance(parts.what, (SendParams, SendDelta)):
        raise TypeError(f"Parts.what must be SendParams() or SendDelta(), got {parts.what!r}.")
    if not isinstance(parts.then, (Assign, OuterStep)):
        raise TypeError(f"Parts.then must be Assign() or OuterStep(optimizer), got {parts.then!r}.")
    options: dict[str, Any] = {"delta": isinstance(parts.what, SendDelta)}
    options["communication"] = parts.how
    if isinstance(parts.then, OuterStep):
        options["outer_optimizer"] = parts.then.optimizer
        options["outer_skip_first"] = parts.then.skip_first
    return options


def from_parts(
    parts: Parts,
    groups: Sequence[GroupSpec] | None = None,
    process_group: GroupSpec = None,
    *,
    offload_state: bool | None = None,
) -> PeriodicModelAverager | HierarchicalModelAverager:
    """The averager whose ``parts`` these are (see ``averager.parts``).

    Any one-level schedule (``PeriodicSchedule``, ``AdaptiveSchedule``, your own
    ``Schedule``) gives a ``PeriodicModelAverager`` over ``process_group``; a
    ``HierarchicalSchedule`` a ``HierarchicalModelAverager``
    with one group per period (``groups``, smallest first, the last one global).

    Args:
      parts: ``averager.parts``, or ``Parts(when, what, how, then)``.
      groups: with a hierarchical schedule, each level's group (axis names).
      process_group: the global axes (None: every mapped axis bound where it runs).
      offload_state: as for the constructors.

    Returns:
      The averager; ``from_parts(avg.parts, ...)`` equals ``avg``.

    Raises:
      TypeError: a part of the wrong kind, or ``groups`` given (or missing) where the
        schedule has one level (or several).

    Example:
      >>> import optax, lsgd_jax
      >>> from lsgd_jax.averaging import from_parts
      >>> avg = lsgd_jax.PeriodicModelAverager(
      ...     32, warmup_steps=100, outer_optimizer=optax.sgd(0.7, momentum=0.9),
      ...     communication=lsgd_jax.comm.quantized(4))
      >>> from_parts(avg.parts) == avg
      True
      >>> from_parts(avg.parts._replace(how=lsgd_jax.comm.flat())).communicator
      Flat()
    """
    options = _options(parts)
    when = parts.when
    if isinstance(when, HierarchicalSchedule):
        if groups is None or len(groups) != len(when.periods):
            raise TypeError(
                f"from_parts: a HierarchicalSchedule with periods {when.periods} needs one "
                f"group per period in groups=, got {groups!r}; e.g. groups=['local', "
                "('node', 'local')]."
            )
        return HierarchicalModelAverager(
            dict(zip(when.periods, groups)),
            when.warmup_steps,
            process_group,
            delay=when.delay,
            offload_state=offload_state,
            **options,
        )
    if groups is not None:
        raise TypeError(
            f"from_parts: {type(when).__name__} has one level; give its group as "
            f"process_group=, not groups={groups!r}."
        )
    if isinstance(when, Schedule):  # its warm-up, fragments and delay come with it
        return PeriodicModelAverager(
            when, process_group=process_group, offload_state=offload_state, **options
        )
    raise TypeError(
        f"Parts.when must be a lsgd_jax.schedules.Schedule, got {when!r}; e.g. "
        "PeriodicSchedule(32, warmup_steps=100)."
    )
