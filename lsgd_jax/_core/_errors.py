"""Exception classes that several rooms raise."""

from __future__ import annotations


class ModelShapeError(ValueError):
    """The model's shapes do not fit an option (e.g. too few values for its fragments).

    A ValueError. The build check of a step raises it only on the user's own params
    (their abstract shapes), never on a stand-in model.

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax.averaging._fragments import Fragment
      >>> try:
      ...     Fragment(0, 4).cut({"w": jnp.zeros(3)})
      ... except ValueError as e:
      ...     print(type(e).__name__, str(e)[:36])
      ModelShapeError fragments=4 needs at least that many
    """
