"""PostLocalSGDState: the step count of the post-local SGD hook, and its logging rule."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from lsgd_jax import comm
from lsgd_jax._core import _collectives, _leaves, _validate
from lsgd_jax._core import _state_protocol as sp
from lsgd_jax._core._collectives import GroupSpec
from lsgd_jax._core._struct import pytree_dataclass

logger = logging.getLogger("lsgd_jax")


def _log_start(iteration: Any) -> None:
    logger.info("Start to apply local SGD after %s iterations.", int(iteration))


def _check_communication(communication: Any, what: str) -> Any:
    """None (the default all-reduce) or a lsgd_jax.comm strategy."""
    from lsgd_jax import comm

    if communication is not None and not isinstance(communication, comm.Communication):
        raise TypeError(
            f"{what}: communication must be a lsgd_jax.comm strategy (e.g. "
            f"lsgd_jax.comm.flat()), got {communication!r}."
        )
    return communication


def keeps_residual(communication: Any) -> bool:
    """Whether ``communication`` keeps per-replica state (error feedback) for the values
    it averages, which the hook then carries in ``PostLocalSGDState.comm_state``: the
    strategy's own ``keeps_state``."""
    return communication is not None and bool(communication.keeps_state)


@pytree_dataclass(omit_if_none="comm_state")  # the structure of a state without
# error feedback is the one it had before the hook could keep a residual
@dataclasses.dataclass(frozen=True, init=False, eq=False, repr=False)
class PostLocalSGDState(sp.PhasedState):
    """The state of :func:`post_localSGD_hook`: a step count and where to average.

    An immutable pytree. Its array leaves are ``iter`` (an int32 scalar, 0 at
    construction), which counts the steps that averaged gradients globally (it stops
    growing at ``start_localSGD_iter``, as in PyTorch), and, only with a communication
    strategy that keeps error feedback (``comm.quantized()``), the residual
    ``comm_state``, created by :meth:`init`. Everything else is static metadata, so the
    state can be a ``jax.jit`` argument, an optax state and a ``lax.scan`` carry, and
    its tree structure follows from its configuration alone.

    Construction logs ``"Local SGD will be started after N iterations"`` through the
    ``logging`` logger ``"lsgd_jax"``.

    Attributes:
      process_group: the mesh axes of the global group, as a tuple, or an IndexGroups;
        ``None`` means every mapped axis bound where the hook runs (every manual axis of
        the enclosing ``jax.shard_map``, or the ``jax.pmap`` axis).
      subgroup: the axes of one node's group; ``None`` means ``("local",)``, the
        intra-node axis of :func:`make_mesh`. Under ``jax.pmap`` pass an IndexGroups.
      start_localSGD_iter: the number of globally averaged steps before local SGD starts.
      post_local_gradient_allreduce: whether gradients are still averaged inside the
        subgroup after the switch (``False``: they are left untouched).
      iter: int32 scalar array, the step count.
      communication: how the gradient means travel: a ``lsgd_jax.comm`` strategy, or
        None for one all-reduce (``comm.flat()``, PyTorch's). Keyword-only, after
        PyTorch's positional signature.
      pinned_phase: None, or (static) the phase the hook takes whatever ``iter`` says:
        set by whoever specializes a step per phase (see :func:`phase_index`), in the
        state's static metadata so that every trace cache keys on it.
      comm_state: None, or the communication strategy's per-replica state: with
        ``comm.quantized(error_feedback=True)``, the error-feedback residual, float32
        zeros shaped like the gradients from :meth:`init`, what rounding dropped from
        this replica's gradients and is sent with its next mean. Per replica: pass the
        state with a leading replica axis (``data_parallel_step`` does). Checkpointed
        with the rest (a leaf path ending in ``.comm_state``).

    Example:
      >>> import lsgd_jax
      >>> state = lsgd_jax.PostLocalSGDState(None, "local", start_localSGD_iter=2)
      >>> int(state.iter), state.subgroup
      (0, ('local',))
      >>> int(state.maybe_increase_iter().maybe_increase_iter().iter)
      2
    """

    COUNTER_FIELD = "iter"
    KIND = sp.HOOK

    iter: jax.Array = sp.field(sp.COUNTER)
    # "blank": the value a checkpoint's structure records in its place (its own line
    # says what changed); the format of saved checkpoints, so never change one.
    process_group: Any = sp.field(sp.CONFIG, metadata={"blank": None})
    subgroup: Any = sp.field(sp.CONFIG, metadata={"blank": None})
    start_localSGD_iter: int = sp.field(sp.CONFIG, metadata={"blank": 0})
    post_local_gradient_allreduce: bool = sp.field(sp.CONFIG, metadata={"blank": True})
    communication: Any = sp.field(sp.CONFIG)
    pinned_phase: int | None = sp.field(sp.PIN, default=None)
    comm_state: Any = sp.field(sp.RESIDUAL, default=None)

    def __init__(
        self,
        process_group: GroupSpec,
        subgroup: GroupSpec,
        start_localSGD_iter: int,
        post_local_gradient_allreduce: bool = True,
        *,
        communication: Any = None,
    ) -> None:
        start = _validate.nonnegative_int(start_localSGD_iter, "start_localSGD_iter")
        fields = {
            "iter": jnp.zeros([], jnp.int32),
            "process_group": _collectives.normalize_group(process_group, "process_group"),
            "subgroup": _collectives.normalize_group(subgroup, "subgroup"),
            "start_localSGD_iter": start,
            "post_local_gradient_allreduce": _validate.boolean(
                post_local_gradient_allreduce, "post_local_gradient_allreduce"
            ),
            "communication": _check_communication(communication, "PostLocalSGDState"),
        }
        for f in dataclasses.fields(self):  # the rest (a field added later too): defaults
            object.__setattr__(self, f.name, fields.get(f.name, f.default))
        logger.info("Local SGD will be started after %s iterations", start)

    def init(self, params: Any = None) -> PostLocalSGDState:
        """The initial state (``iter`` 0) with the communication strategy's state for
        gradients shaped like ``params``: a zero residual with ``comm.quantized()``'s
        error feedback, None otherwise. ``post_local_sgd(...).init(params)`` calls it.

        Args:
          params: the params (or any tree shaped like the gradients); needed only when
            the strategy keeps error feedback. Every leaf must be an array or a Python
            number (integer leaves are kept out of the means).

        Returns:
          A new PostLocalSGDState.

        Raises:
          TypeError: a leaf of ``params`` is not an array (a function, a bool: what a
            whole model object holds besides its params); the message names the leaf
            and the fix (``eqx.partition(model, eqx.is_inexact_array)``).

        Example:
          >>> import jax.numpy as jnp, lsgd_jax
          >>> state = lsgd_jax.PostLocalSGDState(
          ...     None, "local", 4, communication=lsgd_jax.comm.quantized(8))
          >>> state.init({"w": jnp.ones(3)}).comm_state
          {'w': Array([0., 0., 0.], dtype=float32)}
        """
        if params is not None:
            _leaves.refuse_non_arrays(params, "post_local_sgd: init(params)")
        fresh = jnp.zeros([], jnp.int32)
        if not keeps_residual(self.communication):
            return self.replace(iter=fresh, comm_state=None)
        if params is None:
            raise ValueError(
                f"post_localSGD_hook: {self.communication!r} keeps an error-feedback "
                "residual shaped like the gradients on every replica, so the hook's state "
                "needs them: create it with state.init(params) (or "
                "post_local_sgd(...).init(params)), or use error_feedback=False."
            )
        return self.replace(iter=fresh, comm_state=comm.initial_state(self.communication, params))

    @property
    def num_phases(self) -> int:
        """The number of branches the hook has (2, global then node-local; or 1 when
        ``start_localSGD_iter == 0``, node-local from the first step, no branch)."""
        return 1 if self.start_localSGD_iter == 0 else 2

    @property
    def phase(self) -> jax.Array:
        """This state's phase as an int32 scalar (1 before the switch, global mean; 0
        after, node-local), from ``iter`` alone (the same on every replica).

        Example:
          >>> import lsgd_jax
          >>> int(lsgd_jax.PostLocalSGDState(None, None, 2).phase)
          1
        """
        if self.num_phases == 1:
            return jnp.zeros([], jnp.int32)
        return (self.iter < self.start_localSGD_iter).astype(jnp.int32)

    def phase_digits(self, num_steps: int) -> list[int]:
        """The phase at each of the next ``num_steps`` calls, from a snapshot's ``iter``
        (a host int): 1 while it is under ``start_localSGD_iter``."""
        first = int(self.iter)
        return [int(first + t < self.start_localSGD_iter) for t in range(num_steps)]

    @property
    def local_sgd_started(self) -> jax.Array:
        """Whether the hook now averages only inside the subgroup (a boolean scalar)."""
        return self.iter >= self.start_localSGD_iter

    def maybe_increase_iter(self) -> PostLocalSGDState:
        """Returns the state after one more globally averaged step.

        ``iter`` grows by one (saturating, never wrapping). When it reaches
        ``start_localSGD_iter`` this logs, once, ``"Start to apply local SGD after N
        iterations."`` through the ``"lsgd_jax"`` logger. Under ``jax.jit`` the message
        comes from a ``jax.debug.callback`` on the first replica only, in a ``lax.cond``
        that holds no collective; it is compiled in only when that logger is enabled for
        INFO at trace time (configure logging before the first step is traced), so by
        default the program holds no host callback (and ``jax.export`` works).

        Returns:
          A new PostLocalSGDState.

        Example:
          >>> import lsgd_jax
          >>> s = lsgd_jax.PostLocalSGDState(None, None, 1).maybe_increase_iter()
          >>> int(s.iter)
          1
        """
        new_iter = optax.safe_increment(self.iter)
        reached = new_iter == self.start_localSGD_iter
        if isinstance(reached, jax.core.Tracer):
            if not logger.isEnabledFor(logging.INFO):
                return self.replace(iter=new_iter)  # no host callback in the program
            axes = _collectives.bound_axes()
            if axes:
                reached = reached & (lax.axis_index(axes) == 0)
            lax.cond(reached, lambda: jax.debug.callback(_log_start, new_iter), lambda: None)
        elif bool(reached):
            _log_start(new_iter)
        return self.replace(iter=new_iter)

    def __repr__(self) -> str:
        shown = [f.name for f in dataclasses.fields(self) if "blank" in f.metadata]
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in shown)
        pin = "" if self.pinned_phase is None else f", pinned_phase={self.pinned_phase}"
        return f"PostLocalSGDState(iter={self.iter!r}, {fields}{pin})"
