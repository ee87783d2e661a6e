"""The setup for your link, from a one-minute probe: the link between nodes and one
step's compute measured, every candidate's step time predicted from the bytes of its
compiled programs, and the fastest within a quality tolerance returned as a chain."""

from lsgd_jax.planner._candidates import CANDIDATES as CANDIDATES  # the default setups
from lsgd_jax.planner._candidates import Candidate
from lsgd_jax.planner._compute import measure_compute
from lsgd_jax.planner._link import Link
from lsgd_jax.planner._link import fit
from lsgd_jax.planner._link import measure_link
from lsgd_jax.planner._plan import Plan
from lsgd_jax.planner._plan import Row
from lsgd_jax.planner._plan import plan
from lsgd_jax.planner._plan import predict

__all__ = [
    "Candidate",
    "Link",
    "Plan",
    "Row",
    "fit",
    "measure_compute",
    "measure_link",
    "plan",
    "predict",
]
