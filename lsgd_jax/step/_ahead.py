"""What a step will run, known before it runs: the programs of the next calls, replayed
from the step counters, compiled ahead (compile, plan_of, programs_of; and in the
background, a few calls ahead of the steps).
"""

from __future__ import annotations

import abc
import concurrent.futures
import time
from typing import Any

import jax
import numpy as np

from lsgd_jax._core import _validate
from lsgd_jax.step._phase_plan import PhasePlan


class _AheadOfTime(abc.ABC):
    """What a step will run, known before it runs: the programs of the next calls,
    replayed from the step counters, compiled ahead (a part of DataParallelStep)."""

    _plan: PhasePlan
    _compiled: dict[tuple, Any]
    _started: set[int | str]  # programs run, or compiling in the background
    _compiling: dict[int | str, concurrent.futures.Future]
    _executor: concurrent.futures.ThreadPoolExecutor | None

    @abc.abstractmethod
    def jit_args(self, *args: Any) -> tuple[Any, Any, Any, Any]:
        """``(params, model_state, opt_state, batch)`` from the step's own arguments."""

    @abc.abstractmethod
    def _program(self, mode: int | str) -> Any:
        """The jitted program of ``mode``."""

    def _compile_coming(self, jit_args: tuple, modes: list[int]) -> None:
        """Starts compiling, on a thread of its own, the programs of ``modes`` that no
        call has run and no compile has started, for arguments shaped like
        ``jit_args``: a phase's first call then finds its program compiled (or waits
        for the compile already under way) instead of stalling to compile it."""
        new = [m for m in modes if m not in self._started]
        if not new:
            return
        abstract = jax.tree.map(_abstract, jit_args)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="lsgd_jax-compile"
            )
        for mode in new:
            self._started.add(mode)
            program = self._program(mode)  # made here: the cache is the main thread's
            self._compiling[mode] = self._executor.submit(_compile, program, abstract)

    def _wait_for_compile(self, mode: int | str) -> None:
        """Before a call runs ``mode``: waits for its compile, if one is under way (a
        failed one is left to the call, which compiles again and raises)."""
        self._started.add(mode)
        future = self._compiling.pop(mode, None)
        if future is not None:
            concurrent.futures.wait([future])

    def compile(self, *args: Any, num_steps: int) -> dict[int | str, float]:
        """Compiles, without running, the programs of the next ``num_steps`` calls.

        With one program per phase, each phase compiles when it first occurs, which
        stalls that step; a timed or latency-sensitive run calls this first, so that
        no step compiles. Nothing is donated or changed.

        Args:
          *args: the step's own arguments, e.g. ``(params, opt_state, batch)``, as
            the first of those calls will get them.
          num_steps: how many calls to plan for (their phases are replayed from the
            state's counters).

        Returns:
          ``{program: seconds}`` for each program compiled now (a phase index, or
          ``"switch"`` / ``"cond"``); programs compiled before are left out.

        Example:
          >>> import jax.numpy as jnp, optax, lsgd_jax
          >>> mesh = lsgd_jax.make_mesh(2, 4)
          >>> tx = optax.chain(lsgd_jax.post_local_sgd(2), optax.sgd(0.1),
          ...     lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, warmup_steps=2)))
          >>> step = lsgd_jax.data_parallel_step(lambda p, b: jnp.mean((b @ p) ** 2), tx, mesh)
          >>> p = lsgd_jax.replicate(jnp.zeros(3), mesh)
          >>> s = lsgd_jax.replicate(tx.init(jnp.zeros(3)), mesh)
          >>> sorted(step.compile(p, s, jnp.ones((8, 3)), num_steps=6))  # phases 2, 1, 0
          [0, 1, 2]
        """
        seconds: dict[int | str, float] = {}
        jit_args = self.jit_args(*args)
        for mode in dict.fromkeys(self.plan_of(*args, num_steps=num_steps)):
            key = (mode, _signature(jit_args))
            if key not in self._compiled:
                start = time.perf_counter()
                self._compiled[key] = self._program(mode).lower(*jit_args).compile()
                seconds[mode] = time.perf_counter() - start
        return seconds

    def plan_of(self, *args: Any, num_steps: int) -> list[int | str]:
        """The program (phase index, or ``"switch"`` / ``"cond"``) each of the next
        ``num_steps`` calls from these arguments runs, replayed from the step counters."""
        num_steps = _validate.positive_int(num_steps, "num_steps")
        return self._plan.replay(self.jit_args(*args)[2], num_steps)

    def programs_of(self, *args: Any, num_steps: int) -> list[tuple[int | str, Any]]:
        """``(program, jax.stages.Compiled)`` for each program of the next ``num_steps``
        calls, in the order they first occur, compiled where needed (see :meth:`compile`)."""
        self.compile(*args, num_steps=num_steps)
        signature = _signature(self.jit_args(*args))
        modes = dict.fromkeys(self.plan_of(*args, num_steps=num_steps))
        return [(k, self._compiled[k, signature]) for k in modes]


def _signature(jit_args: tuple) -> tuple:
    """What a compiled program is specific to: the arguments' structure, shapes and dtypes."""
    leaves, treedef = jax.tree.flatten(jit_args)
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
