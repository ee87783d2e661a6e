"""lsgd_jax: post-local SGD for JAX and optax, with PyTorch's semantics.

Gradients are averaged over every replica until ``start_localSGD_iter``, then only inside
each node, and models are averaged over all replicas every few steps (Lin et al., "Don't
Use Large Mini-Batches, Use Local SGD", ICLR 2020).
"""

from lsgd_jax import comm
from lsgd_jax import elastic
from lsgd_jax._averaging import HierarchicalModelAverager
from lsgd_jax._averager_state import ModelAveragerState
from lsgd_jax._averaging import PeriodicModelAverager
from lsgd_jax._collectives import AxisNotBoundError
from lsgd_jax._collectives import IndexGroups
from lsgd_jax._collectives import node_groups
from lsgd_jax._hook import post_local_sgd
from lsgd_jax._hook import post_localSGD_hook
from lsgd_jax._mesh import consensus
from lsgd_jax._mesh import data_axes
from lsgd_jax._mesh import make_mesh
from lsgd_jax._mesh import replicate
from lsgd_jax._mesh import unreplicate
from lsgd_jax._optim import PostLocalSGDOptimizerState
from lsgd_jax._optim import model_averaging
from lsgd_jax._optim import post_local_sgd_optimizer
from lsgd_jax._schedule import AdaptiveSchedule
from lsgd_jax._schedule import HierarchicalSchedule
from lsgd_jax._schedule import PeriodicSchedule
from lsgd_jax._report import Collective
from lsgd_jax._stacked import stacked
from lsgd_jax._report import CommunicationReport
from lsgd_jax._report import communication_report
from lsgd_jax._ledger import Ledger
from lsgd_jax._ledger import PhaseBytes
from lsgd_jax._ledger import communication_ledger
from lsgd_jax._state import PostLocalSGDState
from lsgd_jax._pairing import check_configuration
from lsgd_jax._phase import num_phases
from lsgd_jax._phase import phase_index
from lsgd_jax._phase import replay_phases
from lsgd_jax._step import DataParallelStep
from lsgd_jax._step import averager_states
from lsgd_jax._step import data_parallel_step
from lsgd_jax._checkpoint import latest_checkpoint_step
from lsgd_jax._checkpoint import restore_checkpoint
from lsgd_jax._checkpoint import save_checkpoint
from lsgd_jax._checkpoint_files import UnreadableCheckpointError
from lsgd_jax._sync import ReplicasOutOfSyncError
from lsgd_jax._sync import assert_replicas_in_sync
from lsgd_jax._sync import step_counters
from lsgd_jax._compile_cache import use_compilation_cache

__version__ = "0.1.0"

__all__ = [
    "AdaptiveSchedule",
    "AxisNotBoundError",
    "Collective",
    "DataParallelStep",
    "CommunicationReport",
    "HierarchicalModelAverager",
    "HierarchicalSchedule",
    "IndexGroups",
    "Ledger",
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
    "comm",
    "communication_ledger",
    "communication_report",
    "elastic",
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
    "stacked",
    "step_counters",
    "unreplicate",
    "use_compilation_cache",
]
