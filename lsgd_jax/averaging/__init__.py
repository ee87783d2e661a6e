"""Model averaging: the averagers, their state, and their optax transformations."""

from lsgd_jax.averaging._averager_state import ModelAveragerState
from lsgd_jax.averaging._averaging import HierarchicalModelAverager
from lsgd_jax.averaging._averaging import PeriodicModelAverager
from lsgd_jax.averaging._optim import (
    PostLocalSGDOptimizerState,
    model_averaging,
    post_local_sgd_optimizer,
)

__all__ = [
    "HierarchicalModelAverager",
    "ModelAveragerState",
    "PeriodicModelAverager",
    "PostLocalSGDOptimizerState",
    "model_averaging",
    "post_local_sgd_optimizer",
]
