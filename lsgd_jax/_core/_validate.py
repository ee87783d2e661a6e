"""Argument checks shared by every constructor: one spelling of each rule and its message.

Each check returns the value in its canonical type (a Python int, float or bool) or
raises an error that names the argument, shows the bad value, and says what to pass
instead. A number may be spelled as NumPy or JAX spells it: an int check takes Python
ints, NumPy integer scalars and 0-d integer arrays (NumPy, or concrete JAX arrays such
as ``jnp.int32(4)``); a real-number check takes those and the floating ones too. Bools
are never numbers here, and a traced value (inside ``jax.jit``) is refused: a
constructor's arguments configure a program, so they must be known when it is built.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_INT_FIX = "NumPy and JAX integer scalars work too, floats and bools do not"


def _scalar_array(value: Any) -> bool:
    """Whether ``value`` is a NumPy or JAX array (or NumPy scalar) holding one value."""
    return isinstance(value, (np.ndarray, np.generic, jax.Array)) and np.ndim(value) == 0


def _as_int(value: Any) -> int | None:
    """``value`` as a Python int if it is an integer scalar (not a bool), else None."""
    if isinstance(value, (bool, np.bool_)) or isinstance(value, jax.core.Tracer):
        return None
    if isinstance(value, int):
        return int(value)
    if _scalar_array(value) and jnp.issubdtype(value.dtype, jnp.integer):
        return int(value)
    return None


def _is_int(value: Any) -> bool:
    """Whether ``value`` is an integer scalar: a Python int, a NumPy integer, or a 0-d
    integer array (NumPy, or a concrete JAX one); never a bool.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> from lsgd_jax._core import _validate
      >>> [_validate._is_int(v) for v in (4, np.int64(4), jnp.int32(4), True, 4.0)]
      [True, True, True, False, False]
    """
    return _as_int(value) is not None


def _not_int(value: Any, name: str, optional: bool = False) -> str:
    """Why ``value`` is not an int for ``name``, and what to pass (``optional``: None is
    allowed too)."""
    ok = " or None" if optional else ""
    if isinstance(value, jax.core.Tracer):
        return (
            f"{name} must be a concrete int{ok}, got a traced value {value!r}; pass a Python "
            "int (build this outside jax.jit, or take the number from the host)."
        )
    shape = np.shape(value) if isinstance(value, (np.ndarray, jax.Array)) else ()
    if shape:
        return (
            f"{name} must be a single int{ok}, got an array of shape {shape}; pass one "
            f"value, e.g. int(x.item()) ({_INT_FIX})."
        )
    whole = (
        not isinstance(value, (bool, np.bool_))
        and isinstance(value, (float, np.floating))
        and math.isfinite(value)
        and float(value).is_integer()
    )
    fix = f"pass {int(value)}" if whole else "pass a whole number as an int"
    wanted = "a positive int or None" if optional else "a Python int"
    kind = type(value).__name__
    return f"{name} must be {wanted}, got {value!r} ({kind}); {fix} ({_INT_FIX})."


def positive_int(value: Any, name: str) -> int:
    """``value`` as an int >= 1; TypeError for a non-int, ValueError for < 1.

    Integer scalars of NumPy and JAX count as ints (``np.int64(4)``, ``jnp.int32(4)``).

    Example:
      >>> from lsgd_jax._core import _validate
      >>> _validate.positive_int(4, "period")
      4
      >>> _validate.positive_int(0, "period")
      Traceback (most recent call last):
      ...
      ValueError: period must be a positive int, got 0; use 1 or more.
      >>> _validate.positive_int(2.5, "period")
      Traceback (most recent call last):
      ...
      TypeError: period must be a Python int, got 2.5 (float); pass a whole number as an int ...
    """
    n = _as_int(value)
    if n is None:
        raise TypeError(_not_int(value, name))
    if n < 1:
        raise ValueError(f"{name} must be a positive int, got {n}; use 1 or more.")
    return n


def nonnegative_int(value: Any, name: str) -> int:
    """``value`` as an int >= 0; TypeError for a non-int, ValueError for < 0.

    Example:
      >>> from lsgd_jax._core import _validate
      >>> import numpy as np
      >>> _validate.nonnegative_int(np.int64(0), "warmup_steps")
      0
    """
    n = _as_int(value)
    if n is None:
        raise TypeError(_not_int(value, name))
    if n < 0:
        raise ValueError(f"{name} must be a non-negative int, got {n}; use 0 or more.")
    return n


def optional_positive_int(value: Any, name: str) -> int | None:
    """None, or ``value`` as an int >= 1; TypeError for a non-int (a bool included),
    ValueError for < 1.

    Example:
      >>> from lsgd_jax._core import _validate
      >>> _validate.optional_positive_int(None, "max_in_flight") is None
      True
      >>> _validate.optional_positive_int(True, "max_in_flight")
      Traceback (most recent call last):
      ...
      TypeError: max_in_flight must be a positive int or None, got True (bool); ...
    """
    if value is None:
        return None
    n = _as_int(value)
    if n is None:
        raise TypeError(_not_int(value, name, optional=True))
    if n < 1:
        raise ValueError(f"{name} must be a positive int or None, got {n}; use 1 or more, or None.")
    return n


def boolean(value: Any, name: str) -> bool:
    """``value`` if it is True or False; TypeError otherwise (no truthy ints).

    Example:
      >>> from lsgd_jax._core import _validate
      >>> _validate.boolean(1, "delta")
      Traceback (most recent call last):
      ...
      TypeError: delta must be True or False, got 1.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}.")
    return bool(value)


def one_of(value: Any, name: str, options: Sequence[Any], meaning: str = "") -> Any:
    """``value`` if it is one of ``options``; ValueError listing them otherwise.

    Example:
      >>> from lsgd_jax._core import _validate
      >>> _validate.one_of("skip", "nonfinite", ("propagate", "exclude", "skip"))
      'skip'
    """
    if value not in options:
        raise ValueError(f"{name} must be one of {tuple(options)}, got {value!r}{meaning}.")
    return value


def real_number(value: Any, name: str, example: str = "") -> float:
    """``value`` as a finite Python float.

    Takes Python ints and floats, NumPy integer and floating scalars, and 0-d arrays of
    those dtypes (NumPy, or concrete JAX ones such as ``jnp.float32(0.7)``). Refuses
    bools, complex numbers, arrays of other shapes and traced values (TypeError) and
    NaN or infinities (ValueError), naming ``name`` and showing ``example`` as the fix.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> from lsgd_jax._core import _validate
      >>> _validate.real_number(np.float64(0.7), "learning_rate")
      0.7
      >>> _validate.real_number(jnp.float32(0.5), "learning_rate")
      0.5
      >>> _validate.real_number(True, "learning_rate", "learning_rate=0.7")
      Traceback (most recent call last):
      ...
      TypeError: learning_rate must be a real number, got True (bool); pass e.g. ...
    """
    fix = f"pass e.g. {example}" if example else "pass a Python float"
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} must be a concrete number, got a traced value {value!r}; {fix}, "
            "known when this is built (outside jax.jit)."
        )
    shape = np.shape(value) if isinstance(value, (np.ndarray, jax.Array)) else ()
    if shape:
        raise TypeError(
            f"{name} must be a single number, got an array of shape {shape}; {fix} "
            "(a 0-d array or x.item() works)."
        )
    real = isinstance(value, (int, float)) or (
        _scalar_array(value)
        and (jnp.issubdtype(value.dtype, jnp.integer) or jnp.issubdtype(value.dtype, jnp.floating))
    )
    if not real or isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"{name} must be a real number, got {value!r} ({type(value).__name__}); {fix} "
            "(NumPy and JAX scalars work too)."
        )
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}; {fix}.")
    return number
