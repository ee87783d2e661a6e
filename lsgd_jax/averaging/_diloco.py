"""DiLoCo's outer optimizer with a cool-down: Nesterov momentum that ends as a plain average.

The outer step of DiLoCo (Douillard et al., 2023) is ``optax.sgd(0.7, momentum=0.9,
nesterov=True)`` on the averaged change since the last average. Nesterov with momentum
``m`` applies about ``learning_rate / (1 - m)`` of each change in all: 7x at 0.7 / 0.9,
which is what lets the replicas' progress count for more than its average. Two ends of
a run were measured on the language model (benchmarks/RESULTS.md part 8, issue 29):

- kept constant, the momentum keeps moving the model after the inner learning rate has
  decayed, and the loss rises over the last few hundred steps;
- decayed to 0 along a cosine, the outer step applies *less* than the replicas' own
  progress once ``learning_rate < 1 - m`` (the last ~30% of the outer steps), so that
  progress is partly thrown away.

:func:`diloco_outer` keeps the constant step and, over the last ``cooldown`` of the outer
optimizer's updates, turns it linearly into a plain average (learning rate 1, no
momentum), reached exactly at the run's last update: the run ends on the replicas' mean
as it is, like post-local SGD. On the language model at 1,500
steps it ended 0.012 nats per byte ahead of DDP where the cosine ended 0.022 behind (8-bit
averages at H=24, the same bytes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax

from lsgd_jax._core import _validate
from lsgd_jax.schedules import AdaptiveSchedule


def num_outer_steps(num_steps: int, warmup_steps: int, period: int | Callable) -> int:
    """How many global averages a ``PeriodicModelAverager(period, warmup_steps)`` takes
    in a run of ``num_steps``: one at the switch, then one every ``period`` steps (a
    callable period, ``period(step)``: the schedule replayed on the host).

    This is what :func:`diloco_outer` takes as ``num_outer_steps``, whatever the
    averager's ``outer_skip_first``: give ``diloco_outer`` the same ``outer_skip_first``
    and it counts the updates its optimizer performs (one fewer with it).

    Args:
      num_steps: the run's steps (optimizer updates).
      warmup_steps: the averager's ``warmup_steps`` (the hook's switch).
      period: the averager's period, an int or a jit-able ``period(step) -> int``.

    Returns:
      ``ceil((num_steps - warmup_steps) / period)`` for an int, at least 1.

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax.averaging import num_outer_steps
      >>> num_outer_steps(1500, 150, 24)
      57
      >>> num_outer_steps(1500, 150, lambda s: jnp.where(s < 1200, 24, 12))  # 44 + 25
      69
    """
    num_steps = _validate.positive_int(num_steps, "num_outer_steps: num_steps")
    warmup_steps = _validate.nonnegative_int(warmup_steps, "num_outer_steps: warmup_steps")
    if callable(period):
        replayed = AdaptiveSchedule(period, warmup_steps).replay(num_steps)
        return max(1, int(np.count_nonzero(replayed)))
    period = _validate.positive_int(period, "num_outer_steps: period")
    return max(1, math.ceil((num_steps - warmup_steps) / period))


def _in_range(value: Any, name: str, ok: Callable[[float], bool], wanted: str, fix: str) -> float:
    number = _validate.real_number(value, f"diloco_outer: {name}", fix)
    if not ok(number):
        raise ValueError(f"diloco_outer: {name} must be {wanted}, got {value!r}; e.g. {fix}.")
    return number


def _cooled(cooldown: float, updates: int) -> int:
    """``ceil(cooldown * updates)``, at least 1 when both are positive (a product within
    1e-6 of a whole number counts as that number: 0.3 * 10 cools 3 updates, not 4)."""
    if not cooldown or not updates:
        return 0
    return max(1, math.ceil(round(cooldown * updates, 6)))


class DilocoOuter(optax.GradientTransformationExtraArgs):
    """The optax transformation :func:`diloco_outer` returns, carrying the
    ``outer_skip_first`` it counted its updates with: an averager given it as
    ``outer_optimizer`` refuses another ``outer_skip_first`` of its own.

    Attributes:
      outer_skip_first: the value given to ``diloco_outer``.
    """

    outer_skip_first: bool

    def __new__(
        cls,
        init: optax.TransformInitFn,
        update: optax.TransformUpdateExtraArgsFn,
        outer_skip_first: bool = True,
    ) -> DilocoOuter:
        self = super().__new__(cls, init, update)
        self.outer_skip_first = outer_skip_first  # beside the tuple's (init, update)
        return self


def diloco_outer(
    num_outer_steps: int,
    learning_rate: float = 0.7,
    momentum: float = 0.9,
    *,
    cooldown: float = 0.3,
    outer_skip_first: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """DiLoCo's outer optimizer, Nesterov momentum cooling down into a plain average.

    Pass it as an averager's ``outer_optimizer``. Of the run's ``U`` outer updates
    (``num_outer_steps - 1`` with ``outer_skip_first``, else ``num_outer_steps``), the
    last ``C = ceil(cooldown * U)`` (at least 1) cool: update ``k = 0 .. U - 1`` runs at ::

        r = max(0, k - (U - C) + 1) / C          # 1/C, 2/C, ..., 1 over the last C
        lr_k = learning_rate + (1 - learning_rate) * r,    momentum_k = momentum * (1 - r)

    so the updates before are ``optax.sgd(learning_rate, momentum, nesterov=True)`` and
    the last is the replicas' plain mean (learning rate 1, momentum 0). More, e.g. on
    skipped averages: docs/options_in_depth.md.

    Args:
      num_outer_steps: the run's global averages, counted as :func:`num_outer_steps`
        counts them (the one at the switch included).
      learning_rate: the outer learning rate before the cool-down (DiLoCo's 0.7).
      momentum: the Nesterov momentum before the cool-down (DiLoCo's 0.9), in [0, 1).
      cooldown: the fraction of the updates that cool, in [0, 1] (0: plain ``optax.sgd``).
      outer_skip_first: the averager's ``outer_skip_first``; pass the same value.

    Returns:
      A :class:`~lsgd_jax.averaging.DilocoOuter` (with ``cooldown=0``, ``optax.sgd``'s own).

    Raises:
      TypeError: not a number of its kind (a bool, a float for ``num_outer_steps``).
      ValueError: a value out of its range or not finite, named with the range.

    Example:
      Six averages (20 steps, switch 2, H=3): five updates, the last two cooled.

      >>> import jax.numpy as jnp, lsgd_jax
      >>> from lsgd_jax.averaging import diloco_outer, num_outer_steps
      >>> outer = diloco_outer(num_outer_steps(20, 2, 3), 0.7, 0.9, cooldown=0.3)
      >>> averager = lsgd_jax.PeriodicModelAverager(3, warmup_steps=2, outer_optimizer=outer)
      >>> state = outer.init(jnp.zeros(1))
      >>> for _ in range(5):
      ...     _, state = outer.update(jnp.ones(1), state)
      ...     print(*(f"{float(state.hyperparams[k]):.2f}" for k in ("learning_rate", "momentum")))
      0.70 0.90
      0.70 0.90
      0.70 0.90
      0.85 0.45
      1.00 0.00
    """
    total = _validate.positive_int(num_outer_steps, "diloco_outer: num_outer_steps")
    lr = _in_range(learning_rate, "learning_rate", lambda v: v > 0, "positive", "learning_rate=0.7")
    m = _in_range(momentum, "momentum", lambda v: 0 <= v < 1, "a number in [0, 1)", "momentum=0.9")
    share = _in_range(
        cooldown, "cooldown", lambda v: 0 <= v <= 1, "a number in [0, 1]", "cooldown=0.3"
    )
    skip = _validate.boolean(outer_skip_first, "diloco_outer: outer_skip_first")
    if share == 0.0:
        return optax.sgd(lr, momentum=m, nesterov=True)
    updates = total - 1 if skip else total
    cooled = _cooled(share, updates)
    first = updates - cooled  # the first cooled update

    def ramp(count: Any) -> Any:
        if not cooled:  # no update in the run: any is past it
            return jnp.ones_like(count, jnp.float32)
        return jnp.clip((count - first + 1) / cooled, 0.0, 1.0)

    tx = optax.inject_hyperparams(optax.sgd)(
        learning_rate=lambda count: lr * (1.0 - ramp(count)) + ramp(count),
        momentum=lambda count: m * (1.0 - ramp(count)),
        nesterov=True,
    )
    return DilocoOuter(tx.init, tx.update, skip)
