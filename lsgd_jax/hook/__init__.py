"""The post-local SGD gradient hook: PyTorch's post_localSGD_hook as an optax transformation."""

from lsgd_jax.hook._hook import post_local_sgd
from lsgd_jax.hook._hook import post_localSGD_hook
from lsgd_jax.hook._state import PostLocalSGDState

__all__ = [
    "PostLocalSGDState",
    "post_localSGD_hook",
    "post_local_sgd",
]
