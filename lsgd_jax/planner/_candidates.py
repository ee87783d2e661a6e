"""The setups a plan weighs, each a chain around the user's optimizer, with the quality it
cost in our tuned comparisons (docs/lm.md, "Against a tuned DDP")."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
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
      curve: the same gap, to the tuned DDP's final loss, at evenly spaced points of
        the run (the last is ``risk``): how soon the candidate gets within a tolerance.
        None: only at the end.
    """

    name: str
    make: Callable[[Any, int], Any]
    risk: float | None
    measured: str
    curve: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not callable(self.make):
            raise TypeError(f"Candidate {self.name!r}: make must be callable, got {self.make!r}.")
        if self.risk is not None:
            risk = _validate.real_number(self.risk, f"Candidate {self.name!r}: risk", "0.01")
            object.__setattr__(self, "risk", risk)
        if self.curve is not None:
            object.__setattr__(self, "curve", self._checked_curve())

    def _checked_curve(self) -> tuple[float, ...]:
        what = f"Candidate {self.name!r}: curve"
        if isinstance(self.curve, np.ndarray) and self.curve.ndim == 1:
            object.__setattr__(self, "curve", tuple(self.curve.tolist()))
        if not isinstance(self.curve, (list, tuple)) or not self.curve:
            raise TypeError(f"{what} must be a non-empty tuple of gaps, got {self.curve!r}.")
        curve = tuple(_validate.real_number(g, what, "(0.3, 0.05, 0.01)") for g in self.curve)
        if self.risk is None or abs(curve[-1] - self.risk) > 1e-9:
            raise ValueError(
                f"{what} ends at {curve[-1]}, but risk is {self.risk}: the curve's last point "
                "is the final gap, the risk; give risk=curve[-1]."
            )
        return curve

    def reach(self, tolerance: float) -> float | None:
        """The share of the run after which this candidate is within ``tolerance`` of a
        tuned DDP's final loss (linear between the curve's points), or None: never.

        Example:
          >>> import optax
          >>> from lsgd_jax.planner import Candidate
          >>> c = Candidate("c", lambda o, n: o, 0.01, "here", curve=(0.5, 0.1, 0.01))
          >>> round(c.reach(0.1), 4), round(c.reach(0.055), 4), c.reach(0.001)
          (0.6667, 0.8333, None)
        """
        tolerance = _validate.real_number(tolerance, f"Candidate {self.name!r}: tolerance", "0.01")
        if self.risk is None or self.risk > tolerance:
            return None
        if self.curve is None:
            return 1.0
        n, curve = len(self.curve), self.curve
        i = next((i for i, g in enumerate(curve) if g <= tolerance), None)
        if i is None:  # the last point a rounding above the risk: the end reaches it
            return 1.0
        if i == 0:
            return 1 / n
        return float((i + (curve[i - 1] - tolerance) / (curve[i - 1] - curve[i])) / n)


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


# The gaps to the tuned DDP's final loss at steps 100, 200, ..., 1,500 of 1,500 (the
# worst seed and model; docs/lm.md "Against a tuned DDP"), written by
# ``python benchmarks/lm_sweep.py curves`` from benchmarks/results/issue34.
# fmt: off
_CURVES: dict[str, tuple[float, ...]] = {
    "DDP": (1.279, 0.9965, 0.7526, 0.5687, 0.4234, 0.3404, 0.2682, 0.2037,
        0.15, 0.1009, 0.0738, 0.0393, 0.0177, 0.0044, 0.0),
    "4-bit DDP": (1.3031, 1.0097, 0.7736, 0.5739, 0.4379, 0.3675, 0.2746, 0.2083,
        0.1591, 0.1102, 0.0856, 0.055, 0.0303, 0.0141, 0.0101),
    "1/3": (1.3031, 1.0097, 0.7736, 0.5739, 0.4379, 0.3986, 0.272, 0.2102,
        0.1552, 0.0975, 0.0693, 0.0486, 0.0232, 0.0097, 0.0075),
    "1/5": (1.3031, 1.0097, 0.7736, 0.6216, 0.46, 0.3459, 0.244, 0.1873,
        0.1443, 0.1031, 0.0754, 0.0596, 0.0312, 0.0208, 0.0182),
    "H=8": (1.2969, 1.0424, 0.8178, 0.6351, 0.491, 0.3911, 0.2835, 0.2304,
        0.1778, 0.1302, 0.1113, 0.0681, 0.0569, 0.0449, 0.0431),
    "H=16": (1.2969, 1.0427, 0.7977, 0.598, 0.444, 0.3862, 0.2749, 0.2026,
        0.1556, 0.1478, 0.1026, 0.0548, 0.0366, 0.0264, 0.0249),
    "recipe": (1.3031, 1.0684, 0.834, 0.6401, 0.4773, 0.3735, 0.2793, 0.2171,
        0.1628, 0.153, 0.1025, 0.0702, 0.0477, 0.0405, 0.0383),
}
# fmt: on


def _measured(name: str, make: Callable[[Any, int], Any], key: str, where: str) -> Candidate:
    curve = _CURVES[key]
    return Candidate(name, make, curve[-1], where, curve)


_BOTH = "lm and deep, 3 seeds each"
CANDIDATES: tuple[Candidate, ...] = (
    _measured("DDP", _ddp, "DDP", "the reference"),
    _measured("DDP, 4-bit two-level gradient means", _ddp_4bit, "4-bit DDP", _BOTH),
    _measured(
        "DiLoCo H=32, 8-bit averages, 4-bit warm-up to 1/3", _post_local(32, 1 / 3, True),
        "1/3", _BOTH,
    ),
    _measured(
        "DiLoCo H=32, 8-bit averages, 4-bit warm-up to 1/5", _post_local(32, 1 / 5, True),
        "1/5", _BOTH,
    ),
    _measured(
        "plain 8-bit averages H=8, 4-bit warm-up to 1/15", _post_local(8, 1 / 15, False),
        "H=8", "lm and deep, seed 0",
    ),
    _measured(
        "DiLoCo H=16, 8-bit averages, 4-bit warm-up to 1/15", _post_local(16, 1 / 15, True),
        "H=16", "lm, 3 seeds",
    ),
    _measured(
        "slow-link recipe: DiLoCo H=32, 8-bit, 4-bit warm-up to 1/15",
        _post_local(32, 1 / 15, True), "recipe", _BOTH,
    ),
)  # fmt: skip
