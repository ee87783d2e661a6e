"""Checkpoints of a whole training state (orbax), resumable onto any number of replicas."""

from lsgd_jax.checkpoint._checkpoint import (
    latest_checkpoint_step,
    restore_checkpoint,
    save_checkpoint,
)
from lsgd_jax.checkpoint._checkpoint_files import UnreadableCheckpointError
from lsgd_jax.checkpoint._staged import latest_readable_step as latest_readable_step
from lsgd_jax.checkpoint._staged import require_orbax as require_orbax
from lsgd_jax.checkpoint._staged import save_staged as save_staged
from lsgd_jax.checkpoint._staged import stage as stage
from lsgd_jax.checkpoint._staged import step_dir as step_dir

# Not in __all__: what lsgd_jax.elastic uses of this room (its writer process).
_FOR_OTHER_ROOMS = ("latest_readable_step", "require_orbax", "save_staged", "stage", "step_dir")

__all__ = [
    "UnreadableCheckpointError",
    "latest_checkpoint_step",
    "restore_checkpoint",
    "save_checkpoint",
]
