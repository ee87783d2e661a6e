"""The training step: data_parallel_step, its phases and programs, and what it checks."""

from lsgd_jax._core._errors import ModelShapeError
from lsgd_jax.step._compile_cache import use_compilation_cache
from lsgd_jax.step._ledger import Ledger
from lsgd_jax.step._ledger import PhaseBytes
from lsgd_jax.step._ledger import communication_ledger
from lsgd_jax.step._ledger import link_bytes as link_bytes
from lsgd_jax.step._ledger import mesh_nodes as mesh_nodes
from lsgd_jax.step._pairing import check_configuration
from lsgd_jax.step._phase import num_phases
from lsgd_jax.step._phase import phase_index
from lsgd_jax.step._phase import replay_phases
from lsgd_jax.step._stacked import stacked
from lsgd_jax.step._step import DataParallelStep
from lsgd_jax.step._step import averager_states
from lsgd_jax.step._step import data_parallel_step

# Not in __all__: what other rooms use of this one (the planner's link probe).
_FOR_OTHER_ROOMS = ("link_bytes", "mesh_nodes")

__all__ = [
    "Ledger",
    "ModelShapeError",
    "PhaseBytes",
    "DataParallelStep",
    "averager_states",
    "check_configuration",
    "communication_ledger",
    "data_parallel_step",
    "num_phases",
    "phase_index",
    "replay_phases",
    "stacked",
    "use_compilation_cache",
]
