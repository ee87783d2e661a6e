"""The setups a plan weighs, each a chain around the user's optimizer, with the quality it
cost in our tuned comparisons (docs/lm.md, "Against a tuned DDP")."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import optax

from lsgd_jax import averaging, comm, hook
from lsgd_jax._core import _validate


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A setup: its name, how to build its chain, and what it cost in quality.

    Example:
      >>> import optax
      >>> from lsgd_jax.planner import CANDIDATES
      >>> ddp = CANDIDATES[0]
      >>> ddp.name, ddp.risk, len(ddp.make(optax.sgd(0.1), 100))
      ('DDP', 0.0, 2)

    Attributes:
      name: what the table calls it.
      make: ``make(optimizer, num_steps) -> optax chain`` around the user's optimizer.
      risk: the worst final-loss gap to a tuned DDP we measured for it (nats per byte,
        every seed and model), compared with the plan's tolerance; None: not measured,
        so never chosen (the table still shows its prediction).
      measured: where that comes from, for the table.
    """

    name: str
    make: Callable[[Any, int], Any]
    risk: float | None
    measured: str

    def __post_init__(self) -> None:
        if not callable(self.make):
            raise TypeError(f"Candidate {self.name!r}: make must be callable, got {self.make!r}.")
        if self.risk is not None:
            risk = _validate.real_number(self.risk, f"Candidate {self.name!r}: risk", "0.01")
            object.__setattr__(self, "risk", risk)


def _switch(num_steps: int, fraction: float) -> int:
    return max(1, round(num_steps * fraction))


def _ddp(optimizer: Any, num_steps: int) -> Any:
    return optax.chain(hook.post_local_sgd(num_steps), optimizer)


def _ddp_4bit(optimizer: Any, num_steps: int) -> Any:
    means = comm.quantized(4, two_level=True)
    return optax.chain(hook.post_local_sgd(num_steps, communication=means), optimizer)


def _post_local(period: int, fraction: float, outer: bool) -> Callable[[Any, int], Any]:
    def make(optimizer: Any, num_steps: int) -> Any:
        start = _switch(num_steps, fraction)
        outer_step = None
        if outer:
            outer_step = averaging.diloco_outer(
                averaging.num_outer_steps(num_steps, start, period), momentum=0.8, cooldown=0.3
            )
        averager = averaging.PeriodicModelAverager(
            period,
            warmup_steps=start,
            communication=comm.quantized(8, two_level=True),
            outer_optimizer=outer_step,
        )
        warmup_means = comm.quantized(4, two_level=True)
        return optax.chain(
            hook.post_local_sgd(start, communication=warmup_means),
            optimizer,
            averaging.model_averaging(averager),
        )

    return make


# the worst seed's gap, and where it was measured (docs/lm.md, "Against a tuned DDP")
CANDIDATES: tuple[Candidate, ...] = (
    Candidate("DDP", _ddp, 0.0, "the reference"),
    Candidate(
        "DDP, 4-bit two-level gradient means", _ddp_4bit, 0.010,
        "lm and deep, 3 seeds each",
    ),
    Candidate(
        "DiLoCo H=32, 8-bit averages, 4-bit warm-up to 1/3", _post_local(32, 1 / 3, True),
        0.0075, "lm and deep, 3 seeds each",
    ),
    Candidate(
        "plain 8-bit averages H=8, 4-bit warm-up to 1/15", _post_local(8, 1 / 15, False),
        0.043, "lm and deep, seed 0",
    ),
    Candidate(
        "DiLoCo H=16, 8-bit averages, 4-bit warm-up to 1/15", _post_local(16, 1 / 15, True),
        0.025, "lm, seed 0",
    ),
    Candidate(
        "slow-link recipe: DiLoCo H=32, 8-bit, 4-bit warm-up to 1/15",
        _post_local(32, 1 / 15, True), 0.038,
        "lm and deep, 3 seeds each",
    ),
)  # fmt: skip
