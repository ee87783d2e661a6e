"""What an elastic run reports: a record per completed step, and the run's result."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from lsgd_jax.elastic._initialize import logger
from lsgd_jax.elastic._membership import Layout


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One completed step.

    Attributes:
      step: the step's index.
      live_processes: the processes that ran it.
      loss: the mean loss over the live replicas.
      recovery_s: on the first step completed after a failure or a membership change,
        the seconds from the start of the first attempt at it to its end (else None).
      failures: what went wrong on the attempts before (empty if none).
      aux: with ``step_options={"has_aux": True}``, the step's aux as numpy arrays
        (reduced over the live replicas as ``data_parallel_step`` reduces it); else None.
    """

    step: int
    live_processes: tuple[int, ...]
    loss: float
    recovery_s: float | None
    failures: tuple[str, ...] = ()
    aux: Any = None


@dataclasses.dataclass
class ElasticResult:
    """What :meth:`ElasticLoop.run` returns.

    Attributes:
      params, opt_state: this process's per-replica state over ``layout.mesh``.
      layout: the membership the last step ran on.
      records: one :class:`StepRecord` per step this process completed.
      model_state: with ``step_options={"with_model_state": True}``, the per-replica
        model state over ``layout.mesh`` (else None).
    """

    params: Any
    opt_state: Any
    layout: Layout
    records: list[StepRecord]
    model_state: Any = None

    @property
    def state(self) -> tuple[Any, ...]:
        """The loop's state, as ``run(initial_state=...)`` takes it (``(params,
        opt_state)``, or ``(params, model_state, opt_state)`` with model state)."""
        if self.model_state is None:
            return self.params, self.opt_state
        return self.params, self.model_state, self.opt_state


def _record(
    step: int, processes: Any, loss: Any, recovery: Any, failures: Any, aux: Any = None
) -> StepRecord:
    """The step's record; a warning if it followed failures or a membership change."""
    if aux is not None:  # reduced over the replicas: every local shard holds it whole
        aux = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), aux)
    record = StepRecord(step, processes, float(loss), recovery, failures, aux)
    if failures or recovery is not None:
        logger.warning(
            "lsgd_jax.elastic: step %d completed on processes %s after %s (recovery %.2f s)",
            step,
            list(processes),
            "; ".join(failures) or "a membership change",
            recovery or 0.0,
        )
    return record


def _split_outputs(out: tuple[Any, ...], n_state: int) -> tuple[Any, Any, Any]:
    """A step's outputs ``(*state, loss[, aux])`` as ``(state, loss, aux or None)``.

    Example:
      >>> from lsgd_jax.elastic._records import _split_outputs
      >>> _split_outputs(("params", "opt_state", 0.5), 2)
      (('params', 'opt_state'), 0.5, None)
    """
    state, rest = tuple(out[:n_state]), out[n_state:]
    return state, rest[0], rest[1] if len(rest) > 1 else None


def _result(state: tuple[Any, ...], layout: Layout, records: list[StepRecord]) -> ElasticResult:
    params, *model_state, opt_state = state
    return ElasticResult(params, opt_state, layout, records, *model_state)
