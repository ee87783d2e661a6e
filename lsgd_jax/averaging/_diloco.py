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
steps, turns it linearly into a plain average (learning rate 1, no momentum): the end of
the run takes each average as it is, like post-local SGD. On the language model at 1,500
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
from lsgd_jax.schedules._schedule import AdaptiveSchedule


def num_outer_steps(num_steps: int, warmup_steps: int, period: int | Callable) -> int:
    """How many global averages a ``PeriodicModelAverager(period, warmup_steps)`` takes
    in a run of ``num_steps``: one at the switch, then one every ``period`` steps (a
    callable period, ``period(step)``: the schedule replayed on the host).

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


def _number(value: Any, name: str, ok: Any, wanted: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ValueError(f"diloco_outer: {name} must be {wanted}, got {value!r}.")
    return float(value)


def diloco_outer(
    num_outer_steps: int,
    learning_rate: float = 0.7,
    momentum: float = 0.9,
    *,
    cooldown: float = 0.3,
) -> optax.GradientTransformation:
    """DiLoCo's outer optimizer, Nesterov momentum cooling down into a plain average.

    Pass it as an averager's ``outer_optimizer``. It is ``optax.sgd(learning_rate,
    momentum, nesterov=True)`` for the first ``1 - cooldown`` of the outer steps; over
    the last ``cooldown`` of them the learning rate rises linearly to 1 and the momentum
    falls to 0, so the last outer steps apply each average as it is. Its state counts
    outer steps (``optax.inject_hyperparams``: the current values are in
    ``state.hyperparams``), so it goes with the averager's state through checkpoints.

    Args:
      num_outer_steps: the outer steps of the run (:func:`num_outer_steps`); past it
        the step stays a plain average.
      learning_rate: the outer learning rate before the cool-down (DiLoCo's 0.7).
      momentum: the Nesterov momentum before the cool-down (DiLoCo's 0.9), in [0, 1).
      cooldown: the fraction of the outer steps the cool-down takes, in [0, 1] (0: a
        constant ``optax.sgd``, the plain optax transformation).

    Returns:
      An ``optax.GradientTransformation``.

    Raises:
      ValueError: a value out of its range, named with the range.

    Example:
      >>> import optax, lsgd_jax
      >>> from lsgd_jax.averaging import diloco_outer, num_outer_steps
      >>> outer = diloco_outer(num_outer_steps(1500, 150, 24), cooldown=0.3)
      >>> averager = lsgd_jax.PeriodicModelAverager(24, warmup_steps=150,
      ...                                           outer_optimizer=outer)
      >>> tx = optax.chain(lsgd_jax.post_local_sgd(150), optax.adamw(1e-3),
      ...                  lsgd_jax.model_averaging(averager))
    """
    total = _validate.positive_int(num_outer_steps, "diloco_outer: num_outer_steps")
    lr = _number(learning_rate, "learning_rate", lambda v: 0 < v < math.inf, "positive")
    m = _number(momentum, "momentum", lambda v: 0 <= v < 1, "a number in [0, 1)")
    share = _number(cooldown, "cooldown", lambda v: 0 <= v <= 1, "a number in [0, 1]")
    if share == 0.0:
        return optax.sgd(lr, momentum=m, nesterov=True)
    length = max(1, round(share * total))
    start = total - length

    def ramp(count: Any) -> Any:
        return jnp.clip((count - start) / length, 0.0, 1.0)

    return optax.inject_hyperparams(optax.sgd)(
        learning_rate=lambda count: lr + (1.0 - lr) * ramp(count),
        momentum=lambda count: m * (1.0 - ramp(count)),
        nesterov=True,
    )
