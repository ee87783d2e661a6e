"""How a mean travels: communication strategies for the hook and the averagers.

A strategy takes the mean of a pytree over a group of replicas; pass one as
``communication=`` to ``post_local_sgd`` or an averager.
"""

from lsgd_jax.comm._strategies import (
    Communication,
    Compressed,
    FiniteOnly,
    Flat,
    Mean,
    Quantized,
    TwoLevel,
    apply,
    compressed,
    finite_only,
    flat,
    quantized,
    two_level,
)

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
