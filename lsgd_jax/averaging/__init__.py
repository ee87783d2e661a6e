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
from lsgd_jax.averaging._average_call import like_params as like_params
from lsgd_jax.averaging._offload import is_offloaded as is_offloaded
from lsgd_jax.averaging._offload import place as place
from lsgd_jax.averaging._optim import (
    PostLocalSGDOptimizerState,
    model_averaging,
    post_local_sgd_optimizer,
)

# Not in __all__: what other rooms use of this one (data_parallel_step averages its model
# state like the params; replicate and stacked place an offloaded averager's buffers).
_FOR_OTHER_ROOMS = ("is_offloaded", "like_params", "place")

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
