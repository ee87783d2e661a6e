"""The programs of a step, compiled ahead: made once per mode, compiled for the calls
to come on a background thread, or all at once by ``compile``.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np


class Programs:
    """A step's jitted programs by mode (a phase index, ``"switch"`` or ``"cond"``), and
    their compiles: ahead on a background thread, or at once.

    Args:
      make: ``make(mode)`` builds the jitted program of ``mode``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from lsgd_jax.step._ahead import Programs
      >>> programs = Programs(lambda mode: jax.jit(lambda x: x + mode))
      >>> programs.compile([1, 2, 1], (jnp.zeros(2),)).keys()
      dict_keys([1, 2])
      >>> programs.get(2)(jnp.zeros(2))
      Array([2., 2.], dtype=float32)
    """

    def __init__(self, make: Callable[[int | str], Any]) -> None:
        self._make = make
        self._programs: dict[int | str, Any] = {}
        self._compiled: dict[tuple, Any] = {}  # (mode, signature) -> jax.stages.Compiled
        self._started: set[int | str] = set()  # run, or compiling in the background
        self._compiling: dict[int | str, concurrent.futures.Future] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def made(self) -> list[int | str]:
        """The modes whose programs were made, in order."""
        return list(self._programs)

    def compiled_modes(self) -> set[int | str]:
        """The modes compiled by :meth:`compile` (for arguments of any shapes)."""
        return {mode for mode, _ in self._compiled}

    def get(self, mode: int | str) -> Any:
        """The jitted program of ``mode`` (made the first time)."""
        if mode not in self._programs:
            self._programs[mode] = self._make(mode)
        return self._programs[mode]

    def compile_coming(self, modes: Iterable[int | str], args: tuple) -> None:
        """Starts compiling, on a thread of its own, the programs of ``modes`` that no
        call has run and no compile has started, for arguments shaped like ``args``: a
        phase's first call then finds its program compiled (or waits for the compile
        under way) instead of stalling to compile it."""
        new = [m for m in modes if m not in self._started]
        if not new:
            return
        abstract = jax.tree.map(_abstract, args)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="lsgd_jax-compile"
            )
        for mode in new:
            self._started.add(mode)
            program = self.get(mode)  # made here: the cache is the main thread's
            self._compiling[mode] = self._executor.submit(_compile, program, abstract)

    def ready(self, mode: int | str) -> Any:
        """The program of ``mode`` for a call about to run it: waits for its compile if
        one is under way (a failed one is left to the call, which compiles again and
        raises)."""
        self._started.add(mode)
        future = self._compiling.pop(mode, None)
        if future is not None:
            concurrent.futures.wait([future])
        return self.get(mode)

    def compile(self, modes: Iterable[int | str], args: tuple) -> dict[int | str, float]:
        """Compiles, without running, the programs of ``modes`` for ``args``.

        Returns:
          ``{mode: seconds}`` for each program compiled now; those compiled before for
          arguments of these shapes are left out.
        """
        seconds: dict[int | str, float] = {}
        for mode in dict.fromkeys(modes):
            key = (mode, signature(args))
            if key not in self._compiled:
                start = time.perf_counter()
                self._compiled[key] = self.get(mode).lower(*args).compile()
                seconds[mode] = time.perf_counter() - start
        return seconds

    def compiled(self, mode: int | str, args: tuple) -> Any:
        """The ``jax.stages.Compiled`` of ``mode`` for ``args`` (compiled if needed)."""
        self.compile([mode], args)
        return self._compiled[mode, signature(args)]


def signature(args: tuple) -> tuple:
    """What a compiled program is specific to: the arguments' structure, shapes, dtypes.

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax.step._ahead import signature
      >>> signature((jnp.zeros(2),)) == signature((jnp.ones(2),))
      True
    """
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves)


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    """``x``'s shape, dtype, weak type and (for a jax.Array) sharding."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type)
    x = np.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _compile(program: Any, abstract: tuple) -> Any:
    """``program`` compiled for arguments shaped like ``abstract`` (jax's caches keep it
    for the call that comes with real arguments of those shapes)."""
    return program.lower(*abstract).compile()
