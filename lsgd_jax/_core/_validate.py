"""Argument checks shared by every constructor: one spelling of each rule and its message.

Each check returns the value in its canonical type (a Python int, a bool) or raises an
error that names the argument, shows the bad value, and says what to pass instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def positive_int(value: Any, name: str) -> int:
    """``value`` as an int >= 1; TypeError for a non-int, ValueError for < 1.

    Example:
      >>> from lsgd_jax._core import _validate
      >>> _validate.positive_int(4, "period")
      4
      >>> _validate.positive_int(0, "period")
      Traceback (most recent call last):
      ...
      ValueError: period must be a positive int, got 0; use 1 or more.
    """
    if not _is_int(value):
        raise TypeError(f"{name} must be a Python int, got {value!r} ({type(value).__name__}).")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value}; use 1 or more.")
    return int(value)


def nonnegative_int(value: Any, name: str) -> int:
    """``value`` as an int >= 0; TypeError for a non-int, ValueError for < 0.

    Example:
      >>> from lsgd_jax._core import _validate
      >>> _validate.nonnegative_int(0, "warmup_steps")
      0
    """
    if not _is_int(value):
        raise TypeError(f"{name} must be a Python int, got {value!r} ({type(value).__name__}).")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value}; use 0 or more.")
    return int(value)


def optional_positive_int(value: Any, name: str) -> int | None:
    """None, or ``value`` as an int >= 1.

    Example:
      >>> from lsgd_jax._core import _validate
      >>> _validate.optional_positive_int(None, "max_in_flight") is None
      True
    """
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int or None, got {value!r}.")
    return int(value)


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
