"""Exception classes that several rooms raise."""

from __future__ import annotations


class ModelShapeError(ValueError):
    """The model's shapes do not fit an option (e.g. too few values for its fragments).

    A ValueError. A step's build check raises it on your own params (their abstract
    shapes: ``example_params=`` or the first call's), never on a stand-in model.

    Example:
      >>> import jax.numpy as jnp, optax, lsgd_jax
      >>> avg = lsgd_jax.PeriodicModelAverager(4, warmup_steps=2, fragments=4)
      >>> tx = optax.chain(lsgd_jax.post_local_sgd(2), optax.sgd(0.1),
      ...                  lsgd_jax.model_averaging(avg))
      >>> try:
      ...     lsgd_jax.data_parallel_step(lambda p, b: 0.0, tx, lsgd_jax.make_mesh(2, 4),
      ...                                 example_params=jnp.zeros(3))
      ... except lsgd_jax.ModelShapeError as e:
      ...     print(str(e).split(". ")[-1])
      fragments=4 needs at least that many floating values to split, got 3; use fewer fragments.
    """
