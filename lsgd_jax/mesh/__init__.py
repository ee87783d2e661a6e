"""Meshes, replicas and groups: one row of devices per node, per-replica values, the
checks that replicas agree, and simulated CPU devices with the threads they need."""

from lsgd_jax._core._collectives import AxisNotBoundError
from lsgd_jax._core._collectives import IndexGroups
from lsgd_jax._core._collectives import node_groups
from lsgd_jax.mesh._mesh import consensus
from lsgd_jax.mesh._mesh import data_axes
from lsgd_jax.mesh._mesh import make_mesh
from lsgd_jax.mesh._mesh import replicate
from lsgd_jax.mesh._mesh import unreplicate
from lsgd_jax.mesh._sync import ReplicasOutOfSyncError
from lsgd_jax.mesh._sync import assert_replicas_in_sync
from lsgd_jax.mesh._sync import step_counters
from lsgd_jax.mesh._threads import check_cpu_threads
from lsgd_jax.mesh._threads import simulate_cpu_devices

__all__ = [
    "AxisNotBoundError",
    "IndexGroups",
    "ReplicasOutOfSyncError",
    "assert_replicas_in_sync",
    "check_cpu_threads",
    "consensus",
    "data_axes",
    "make_mesh",
    "node_groups",
    "replicate",
    "simulate_cpu_devices",
    "step_counters",
    "unreplicate",
]
