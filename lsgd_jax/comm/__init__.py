"""How a mean travels: communication strategies for the hook and the averagers.

A strategy takes the mean of a pytree over a group of replicas (mesh axes, or an
IndexGroups under ``pmap``) inside ``shard_map``/``pmap``. The hook
(:func:`~lsgd_jax.post_local_sgd`, ``communication=``) uses it for the gradient means,
the averagers (``communication=``) for the model averages; both only call
``strategy.mean(...)``, so a new way to communicate is a new strategy, not a change to
them.

- :func:`flat`: one all-reduce of every floating leaf (PyTorch's behaviour; the default).
- :func:`finite_only`: the same all-reduce with a finiteness flag riding along, so that
  a replica with NaN/Inf values is left out (``"exclude"``) or its group does not
  average (``"skip"``).
- :func:`compressed`: the values travel in a narrower dtype (bfloat16), summed in
  float32 (an all-to-all and an all-gather: half the bytes of a float32 all-reduce).
- :func:`two_level`: a global mean as reduce-scatter inside the node, all-reduce across
  nodes, all-gather inside the node: each value crosses the slow link about once.
- :func:`quantized`: the values travel as 8- or 4-bit integers with per-block scales
  (about a quarter or an eighth of the float32 bytes), with error feedback: what
  rounding dropped is kept per replica and sent with the next mean.

Writing a strategy (subclass :class:`Communication`; the contract every strategy keeps):
docs/internals.md, "Writing a communication strategy".

Example:
  >>> import jax.numpy as jnp, optax, lsgd_jax
  >>> tx = optax.chain(
  ...     lsgd_jax.post_local_sgd(100, communication=lsgd_jax.comm.flat()),
  ...     optax.sgd(0.1),
  ...     lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(
  ...         8, warmup_steps=100, communication=lsgd_jax.comm.compressed(jnp.bfloat16))),
  ... )
"""

from lsgd_jax.comm._base import Communication
from lsgd_jax.comm._base import Mean
from lsgd_jax.comm._base import apply
from lsgd_jax.comm._base import initial_state as initial_state
from lsgd_jax.comm._strategies import Compressed
from lsgd_jax.comm._strategies import FiniteOnly
from lsgd_jax.comm._strategies import Flat
from lsgd_jax.comm._strategies import Quantized
from lsgd_jax.comm._strategies import TwoLevel
from lsgd_jax.comm._strategies import compressed
from lsgd_jax.comm._strategies import finite_only
from lsgd_jax.comm._strategies import flat
from lsgd_jax.comm._strategies import quantized
from lsgd_jax.comm._strategies import two_level

# Names lsgd_jax.comm had as a module (before commit 9c4ecf6), kept as they were:
# attributes, not in __all__. NONFINITE_POLICIES: finite_only's policies.
from lsgd_jax._core._collectives import Group as Group
from lsgd_jax.comm._base import logger as logger
from lsgd_jax.comm._strategies import FINITE_ONLY_POLICIES as NONFINITE_POLICIES  # noqa: F401

# Not in __all__: what other rooms use of this one (the hook's and the averagers' init;
# NONFINITE_POLICIES, the averagers' nonfinite= choices).
_FOR_OTHER_ROOMS = ("NONFINITE_POLICIES", "initial_state")

__all__ = [
    "Communication",
    "Compressed",
    "FiniteOnly",
    "Flat",
    "Mean",
    "Quantized",
    "TwoLevel",
    "apply",
    "compressed",
    "finite_only",
    "flat",
    "quantized",
    "two_level",
]
