"""Checkpoints of a whole training state (orbax), resumable onto any number of replicas."""

from lsgd_jax.checkpoint._checkpoint import (
    latest_checkpoint_step,
    restore_checkpoint,
    save_checkpoint,
)
from lsgd_jax.checkpoint._checkpoint_files import UnreadableCheckpointError

__all__ = [
    "UnreadableCheckpointError",
    "latest_checkpoint_step",
    "restore_checkpoint",
    "save_checkpoint",
]
