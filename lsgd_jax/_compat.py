"""What lsgd_jax needs from JAX that has no public API yet, in one place.

Each function here reaches into ``jax._src``; ``tests/test_compat.py`` checks that every
one still finds what it needs, so a JAX release that moves them fails that test loudly
instead of the library failing (or silently degrading) elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def mapped_axis_names() -> tuple[Any, ...]:
    """The names of the ``pmap`` / ``vmap`` axes bound where this runs (none: ``()``).

    ``shard_map``'s manual axes are public (``jax.sharding.get_abstract_mesh()``); the
    named axes of ``pmap`` are not.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from lsgd_jax import _compat
      >>> jax.vmap(lambda x: x + len(_compat.mapped_axis_names()), axis_name="i")(jnp.zeros(2))
      Array([1., 1.], dtype=float32)
    """
    from jax._src import core

    return tuple(core.unsafe_get_axis_names())


def all_gather_invariant() -> Callable[..., Any] | None:
    """JAX's ``all_gather_invariant`` (an all-gather typed as invariant), if present.

    ``lax.all_gather`` types its result as varying over the axis although every replica
    holds the same values; the invariant form says so, which lets the result become a
    replicated value. None when this JAX has no such function (callers then use
    ``lax.all_gather``).

    Example:
      >>> from lsgd_jax import _compat
      >>> callable(_compat.all_gather_invariant())
      True
    """
    from jax._src.lax import parallel

    return getattr(parallel, "all_gather_invariant", None)
