"""When to average: schedules as small frozen values (periodic, hierarchical, adaptive)."""

from lsgd_jax.schedules._schedule import AdaptiveSchedule
from lsgd_jax.schedules._schedule import HierarchicalSchedule
from lsgd_jax.schedules._schedule import PeriodicSchedule

__all__ = [
    "AdaptiveSchedule",
    "HierarchicalSchedule",
    "PeriodicSchedule",
]
