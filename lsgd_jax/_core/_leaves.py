"""Which leaves a tree of params may hold: one rule and one message for ``replicate`` and
the optimizer states' ``init``.

A whole model object (an Equinox module, say) carries more than its params: functions
(an activation), and settings stored as Python values (dropout's rate ``p`` and its
``inference`` flag). Those break far from where they came in ("Dtype object is not a valid
JAX array type", "zeros_like requires ndarray", "grad requires real-valued inputs, got
bool"), so the calls that first see the params refuse them, naming the leaf and the fix.

The rule:

- arrays (NumPy, JAX, abstract ``ShapeDtypeStruct`` or traced values) of any dtype pass;
- a Python bool, or any value that is not a number (a function, a string, an object), is
  refused: it cannot be a param, and one copy per replica of it means nothing;
- a Python int, float or complex passes (plain JAX takes it as a weakly typed scalar),
  but :func:`replicate` names it, since in a model it is more often a setting than a
  value to train (``jnp.asarray(x)`` says it is meant as one);
- where gradients flow (``post_local_sgd``'s init), only floating values pass: ``jax.grad``
  refuses integer and bool inputs.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FIX = (
    "Pass only the arrays to train: with Equinox, "
    "`params, static = eqx.partition(model, eqx.is_inexact_array)` and use `params` here "
    "(rebuild the model inside the loss with `eqx.combine(params, static)`), or "
    "`eqx.filter(model, eqx.is_inexact_array)`; with Flax NNX, `nnx.split(model, nnx.Param)`."
)


def _name(path: Any) -> str:
    return jax.tree_util.keystr(path) or "(root)"


def _is_array(x: Any) -> bool:
    """An array of any kind: NumPy, JAX (concrete or traced), or abstract shapes."""
    return isinstance(x, (np.ndarray, np.generic, jax.Array, jax.ShapeDtypeStruct)) or (
        hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, type)
    )


def _describe(x: Any) -> str:
    if callable(x) and isinstance(getattr(x, "__name__", None), str):
        return f"the function {x.__name__} ({type(x).__name__})"
    text = repr(x)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(x).__name__})"


def refuse_non_arrays(tree: Any, who: str) -> None:
    """Refuses a leaf of ``tree`` that is neither an array nor a Python number, and a
    Python bool.

    Args:
      tree: a pytree of params (or of any values to lay out per replica).
      who: the caller's name, for the message.

    Raises:
      TypeError: naming the first such leaf (its key path), its value, and the fix.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from lsgd_jax._core import _leaves
      >>> _leaves.refuse_non_arrays({"w": jnp.ones(2), "act": jax.nn.relu}, "replicate")
      Traceback (most recent call last):
      ...
      TypeError: replicate: leaf ['act'] is the function relu (custom_jvp), not an array: ...
    """
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if _is_array(x):
            continue
        if isinstance(x, bool):
            raise TypeError(
                f"{who}: leaf {_name(path)} is the Python bool {x}, a setting, not a "
                "value to train or average (jax.grad refuses bool inputs; Equinox keeps "
                f"flags such as Dropout's `inference` in the model as bools). {FIX}"
            )
        if not isinstance(x, (int, float, complex)):
            raise TypeError(
                f"{who}: leaf {_name(path)} is {_describe(x)}, not an array: only arrays "
                "(and numbers) can be params, laid out one copy per replica and averaged. "
                "A whole model object also holds its functions and settings (e.g. an "
                f"Equinox module's activation). {FIX}"
            )


def refuse_non_floating(tree: Any, who: str) -> None:
    """:func:`refuse_non_arrays`, and refuses integer and bool arrays and Python ints:
    for trees shaped like the gradients, which ``jax.grad`` gives only for floating
    inputs.

    Args:
      tree: a pytree of params.
      who: the caller's name, for the message.

    Raises:
      TypeError: naming the first such leaf (its key path), its dtype, and the fix.

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax._core import _leaves
      >>> _leaves.refuse_non_floating({"w": jnp.ones(2), "pos": jnp.arange(3)}, "init")
      Traceback (most recent call last):
      ...
      TypeError: init: leaf ['pos'] is an int32 array of shape (3,): gradients flow only ...
    """
    refuse_non_arrays(tree, who)
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(x, (float, complex)) and not isinstance(x, bool):
            continue
        dtype = np.dtype(type(x)) if isinstance(x, int) else x.dtype
        if not jnp.issubdtype(dtype, jnp.inexact):
            what = (
                f"the Python int {x}"
                if isinstance(x, int)
                else f"a{'n' if str(dtype)[0] in 'aeiou' else ''} {dtype} array of shape "
                f"{tuple(x.shape)}"
            )
            raise TypeError(
                f"{who}: leaf {_name(path)} is {what}: gradients flow only through "
                "floating values (jax.grad refuses integer and bool inputs), so it cannot "
                "be a param. Keep it with the model's fixed parts (with Equinox, partition "
                "with eqx.is_inexact_array, not eqx.is_array, which also keeps integer "
                f"arrays). {FIX}"
            )


def name_python_numbers(tree: Any, who: str, copies: int) -> None:
    """Warns (once a call) about the Python int, float and complex leaves of ``tree``:
    replicated, each becomes an array of ``copies`` values, trained and averaged like
    the params, which a model's settings (Equinox's ``Dropout(p=...)``) should not be.

    Args:
      tree: a pytree about to be replicated.
      who: the caller's name, for the message.
      copies: the number of replicas.

    Example:
      >>> import warnings, jax.numpy as jnp
      >>> from lsgd_jax._core import _leaves
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     _leaves.name_python_numbers({"w": jnp.ones(2), "p": 0.1}, "replicate", 8)
      >>> str(caught[0].message)[:64]
      "replicate: leaf ['p'] is a Python float (0.1): replicated, it is"
    """
    found = [
        (_name(path), x)
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
        if isinstance(x, (int, float, complex)) and not isinstance(x, bool)
    ]
    if not found:
        return
    listed = ", ".join(f"{n} is a Python {type(x).__name__} ({x})" for n, x in found[:4])
    more = f" and {len(found) - 4} more" if len(found) > 4 else ""
    x = found[0][1]
    one = len(found) == 1
    it = (
        f"it is an array of {copies} {jnp.asarray(x).dtype} copies"
        if one
        else (f"each is an array of {copies} copies")
    )
    warnings.warn(
        f"{who}: {'leaf' if one else 'leaves'} {listed}{more}: replicated, {it}, one per "
        "replica, that a step trains and averages like the params. If it is meant as a "
        f"value, pass jnp.asarray({x}) (no warning); if it "
        f"is a setting (e.g. Equinox's Dropout(p=...)), leave it out of the tree. {FIX}",
        UserWarning,
        stacklevel=3,
    )
