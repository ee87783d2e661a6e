"""When to average: schedules as small frozen values (periodic, hierarchical, adaptive),
and :class:`Schedule`, the base of your own."""

from lsgd_jax.schedules._schedule import AdaptiveSchedule
from lsgd_jax.schedules._schedule import HierarchicalSchedule
from lsgd_jax.schedules._schedule import PeriodicSchedule
from lsgd_jax.schedules._schedule import Schedule

__all__ = [
    "AdaptiveSchedule",
    "HierarchicalSchedule",
    "PeriodicSchedule",
    "Schedule",
]
