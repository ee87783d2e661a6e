"""Elastic post-local SGD: keep training when a process dies, take it back when it returns.

See :class:`ElasticLoop` and docs/failures.md.
"""

from lsgd_jax.elastic._loop import ElasticLoop
from lsgd_jax.elastic._loop import ElasticResult
from lsgd_jax.elastic._loop import StepRecord
from lsgd_jax.elastic._loop import initialize
from lsgd_jax.elastic._loop import shutdown
from lsgd_jax.elastic._membership import CoordinatorLostError
from lsgd_jax.elastic._membership import Layout
from lsgd_jax.elastic._membership import LeftBehindError

__all__ = [
    "CoordinatorLostError",
    "ElasticLoop",
    "ElasticResult",
    "Layout",
    "LeftBehindError",
    "StepRecord",
    "initialize",
    "shutdown",
]
