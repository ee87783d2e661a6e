"""Model averaging: the averagers, their state, and their optax transformations."""

from lsgd_jax.averaging._averager_state import ModelAveragerState
from lsgd_jax.averaging._averaging import HierarchicalModelAverager
from lsgd_jax.averaging._averaging import PeriodicModelAverager
from lsgd_jax.averaging._diloco import DilocoOuter, diloco_outer, num_outer_steps
from lsgd_jax.averaging._from_parts import from_parts
from lsgd_jax.averaging._outer import Assign
from lsgd_jax.averaging._outer import OuterStep
from lsgd_jax.averaging._outer import Parts
from lsgd_jax.averaging._outer import SendDelta
from lsgd_jax.averaging._outer import SendParams
from lsgd_jax.averaging._optim import (
    PostLocalSGDOptimizerState,
    model_averaging,
    post_local_sgd_optimizer,
)

__all__ = [
    "Assign",
    "HierarchicalModelAverager",
    "ModelAveragerState",
    "OuterStep",
    "Parts",
    "PeriodicModelAverager",
    "PostLocalSGDOptimizerState",
    "SendDelta",
    "SendParams",
    "DilocoOuter",
    "diloco_outer",
    "from_parts",
    "model_averaging",
    "num_outer_steps",
    "post_local_sgd_optimizer",
]
