"""The post-local SGD gradient hook: PyTorch's post_localSGD_hook as an optax transformation."""

from lsgd_jax.hook._hook import DEFAULT_SUBGROUP as DEFAULT_SUBGROUP
from lsgd_jax.hook._hook import post_local_sgd
from lsgd_jax.hook._hook import post_localSGD_hook
from lsgd_jax.hook._state import PostLocalSGDState

# Not in __all__: what other rooms use of this one (the step's pairing check).
_FOR_OTHER_ROOMS = ("DEFAULT_SUBGROUP",)

__all__ = [
    "PostLocalSGDState",
    "post_localSGD_hook",
    "post_local_sgd",
]
