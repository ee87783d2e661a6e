"""lsgd_jax: post-local SGD for JAX and optax, with PyTorch's semantics.

Gradients are averaged over every replica until ``start_localSGD_iter``, then only inside
each node, and models are averaged over all replicas every few steps (Lin et al., "Don't
Use Large Mini-Batches, Use Local SGD", ICLR 2020).
"""

# One namespace per concern (each built from private modules), re-exported here: the
# names a user needs, with one import line each (as optax does).
from lsgd_jax import averaging
from lsgd_jax import checkpoint
from lsgd_jax import comm
from lsgd_jax import elastic
from lsgd_jax import hook
from lsgd_jax import mesh
from lsgd_jax import planner
from lsgd_jax import report
from lsgd_jax import schedules
from lsgd_jax import step
from lsgd_jax.averaging import HierarchicalModelAverager
from lsgd_jax.averaging import ModelAveragerState
from lsgd_jax.averaging import PeriodicModelAverager
from lsgd_jax.averaging import PostLocalSGDOptimizerState
from lsgd_jax.averaging import model_averaging
from lsgd_jax.averaging import post_local_sgd_optimizer
from lsgd_jax.checkpoint import UnreadableCheckpointError
from lsgd_jax.checkpoint import latest_checkpoint_step
from lsgd_jax.checkpoint import restore_checkpoint
from lsgd_jax.checkpoint import save_checkpoint
from lsgd_jax.hook import PostLocalSGDState
from lsgd_jax.hook import post_localSGD_hook
from lsgd_jax.hook import post_local_sgd
from lsgd_jax.mesh import AxisNotBoundError
from lsgd_jax.mesh import IndexGroups
from lsgd_jax.mesh import ReplicasOutOfSyncError
from lsgd_jax.mesh import assert_replicas_in_sync
from lsgd_jax.mesh import check_cpu_threads
from lsgd_jax.mesh import consensus
from lsgd_jax.mesh import data_axes
from lsgd_jax.mesh import make_mesh
from lsgd_jax.mesh import node_groups
from lsgd_jax.mesh import replicate
from lsgd_jax.mesh import simulate_cpu_devices
from lsgd_jax.mesh import step_counters
from lsgd_jax.mesh import unreplicate
from lsgd_jax.planner import plan
from lsgd_jax.report import Collective
from lsgd_jax.report import CommunicationReport
from lsgd_jax.report import communication_report
from lsgd_jax.schedules import AdaptiveSchedule
from lsgd_jax.schedules import HierarchicalSchedule
from lsgd_jax.schedules import PeriodicSchedule
from lsgd_jax.step import DataParallelStep
from lsgd_jax.step import Ledger
from lsgd_jax.step import ModelShapeError
from lsgd_jax.step import PhaseBytes
from lsgd_jax.step import communication_ledger
from lsgd_jax.step import averager_states
from lsgd_jax.step import check_configuration
from lsgd_jax.step import data_parallel_step
from lsgd_jax.step import num_phases
from lsgd_jax.step import phase_index
from lsgd_jax.step import replay_phases
from lsgd_jax.step import stacked
from lsgd_jax.step import use_compilation_cache
from lsgd_jax import _moved

_moved.install()  # the old private module paths, for one release, with a warning

__version__ = "0.1.0"

__all__ = [
    "averaging",
    "checkpoint",
    "hook",
    "mesh",
    "planner",
    "report",
    "schedules",
    "step",
    "AdaptiveSchedule",
    "AxisNotBoundError",
    "Collective",
    "DataParallelStep",
    "CommunicationReport",
    "HierarchicalModelAverager",
    "HierarchicalSchedule",
    "IndexGroups",
    "Ledger",
    "ModelShapeError",
    "ModelAveragerState",
    "PeriodicModelAverager",
    "PeriodicSchedule",
    "PhaseBytes",
    "PostLocalSGDOptimizerState",
    "PostLocalSGDState",
    "ReplicasOutOfSyncError",
    "UnreadableCheckpointError",
    "assert_replicas_in_sync",
    "averager_states",
    "check_configuration",
    "check_cpu_threads",
    "comm",
    "communication_ledger",
    "communication_report",
    "elastic",
    "plan",
    "consensus",
    "data_axes",
    "data_parallel_step",
    "latest_checkpoint_step",
    "make_mesh",
    "model_averaging",
    "node_groups",
    "num_phases",
    "phase_index",
    "post_localSGD_hook",
    "post_local_sgd",
    "post_local_sgd_optimizer",
    "replay_phases",
    "replicate",
    "restore_checkpoint",
    "save_checkpoint",
    "simulate_cpu_devices",
    "stacked",
    "step_counters",
    "unreplicate",
    "use_compilation_cache",
]
