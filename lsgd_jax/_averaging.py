"""Model averagers: PeriodicModelAverager and HierarchicalModelAverager.

An averager is an immutable, hashable config; its mutable part is a ModelAveragerState
(the step count, and where an option needs them, the params at the last global average
and an outer optimizer's state). ``average_parameters`` runs one ``lax.cond`` /
``lax.switch`` per step on a predicate derived only from the state's counters, so every
replica takes the same branch and at most one group's collective runs per step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from lsgd_jax import _collectives, _validate
from lsgd_jax._collectives import Group, GroupSpec
from lsgd_jax._state import logger

_PERIOD_ONE = (
    "When period is 1, no need to use model averaging because the communication cost of "
    "all-reducing parameters will be no less than the cost of all-reducing gradients in "
    "the backward pass. Therefore, only plain data-parallel averaging of gradients should "
    "be used for this case."
)
NONFINITE_POLICIES = ("propagate", "exclude", "skip")

_OPTIONS_DOC = """
      nonfinite: what a replica with NaN/Inf params does to an average: ``"propagate"``
        (default, PyTorch's behaviour: the whole group's element becomes NaN),
        ``"exclude"`` (the mean of the finite replicas only, which the non-finite ones
        also receive: ``average_parameters`` heals them; through ``model_averaging`` a
        replica whose update is non-finite is healed, one whose params already are
        keeps its NaN elements, since ``apply_updates`` adds to them, but cannot spread
        them) or ``"skip"`` (a group with a non-finite replica does not average this
        time). A skipped average (``"skip"`` with a non-finite replica, ``"exclude"``
        with no finite one) changes nothing but the step: the params keep their local
        values, and the anchor, the outer optimizer's state and its count stay as they
        were. Both log a warning naming the replica and step through the
        ``"lsgd_jax"`` logger (a host callback, compiled in while that logger is enabled
        for WARNING at trace time); still one collective per average.
      outer_optimizer: an optax transformation applied, at each global average, to the
        pseudo-gradient ``anchor - mean(params)``, where ``anchor`` is the params at the
        previous global average; the new params are ``anchor + updates`` (SlowMo, Wang
        et al., ICLR 2020; DiLoCo, Douillard et al., 2023: ``optax.sgd(0.7,
        momentum=0.9, nesterov=True)``). ``optax.sgd(1.0)`` is plain averaging, exactly.
        Its state and the anchor live in the averager's state: ``init(params)``. Only
        floating leaves take the outer step; integer leaves keep their own values.
      outer_skip_first: the first global average is a plain average that sets the
        anchor, and the outer optimizer acts from the second one on (default). Otherwise
        the anchor is the params given to ``init``, and the first outer step, at the
        switch, takes the whole synchronous warm-up as one pseudo-gradient: with
        Nesterov momentum that overshoots it (measured on digits: accuracy dips to 93%
        after the switch; see benchmarks/RESULTS.md). False matches DiLoCo without a
        warm-up phase.
      communication_dtype: e.g. ``jnp.bfloat16``: send the average in this dtype (an
        all-to-all and an all-gather, about half the bytes of a float32 all-reduce) and
        sum it in float32. The params are then rounded to this dtype at each average
        unless ``delta=True``.
      delta: average ``params - anchor`` (the change since the last global average)
        instead of the params, and add it back to the anchor: with
        ``communication_dtype`` the rounding then falls on the small change only.
        Needs ``init(params)``.
"""


def _check_nonfinite(policy: Any) -> None:
    _validate.one_of(
        policy,
        "nonfinite",
        NONFINITE_POLICIES,
        ": 'propagate' (PyTorch's behaviour: a NaN spreads to the whole group), 'exclude' "
        "(average the finite replicas only) or 'skip' (no average for a group with a NaN)",
    )


def _log_nonfinite(policy: str, step: Any, replica: Any, excluded: Any) -> None:
    action = {
        "exclude": "left out of the mean and given the mean of the finite replicas",
        "skip": "so its group skipped this average and kept its local values",
    }[policy]
    logger.warning(
        "Model averaging at step %s: replica %s has non-finite params (%s of its group "
        "non-finite); %s.",
        int(step),
        int(replica),
        int(excluded),
        action,
    )


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["step", "anchor", "outer_state", "outer_count", "last_sync"],
    meta_fields=["averager", "pinned_phase"],
)
@dataclasses.dataclass(frozen=True, eq=False)
class ModelAveragerState:
    """The state of a model averager: its step count, and (static) which averager.

    A pytree. ``averager`` is static metadata, so a training loop can tell from an
    optimizer state alone when, and over which group, the models were averaged (e.g. to
    average batch-norm statistics on the same steps). The other fields are None unless
    an option of the averager needs them.

    Attributes:
      step: int32 scalar, the number of ``average_parameters`` calls so far (PyTorch's
        ``averager.step``). At the int32 maximum it continues from an earlier step at the
        same place in the schedule (whole cycles back, see ``averager.cycle``), so the
        averages stay on schedule; a schedule without a cycle (a callable period) raises
        OverflowError there instead.
      averager: the PeriodicModelAverager or HierarchicalModelAverager that owns it.
      anchor: the params at the last global average (``outer_optimizer``, ``delta``).
      outer_state: the outer optimizer's state.
      outer_count: int32 scalar, the global averages so far (``outer_optimizer``).
      last_sync: int32 scalar, the step of the last average (a callable ``period``).
      pinned_phase: None, or (static) the level this call takes whatever the counters
        say: set by whoever specializes a step per phase (see :func:`phase_index`), in
        the static metadata so that every trace cache keys on it.

    Example:
      >>> import lsgd_jax
      >>> state = lsgd_jax.PeriodicModelAverager(4).init()
      >>> int(state.step), state.averager.period
      (0, 4)
    """

    step: jax.Array
    averager: Any = None
    anchor: Any = None
    outer_state: Any = None
    outer_count: Any = None
    last_sync: Any = None
    pinned_phase: int | None = None

    @property
    def num_phases(self) -> int:
        """How many branches the averager has: one per level, plus "no average"."""
        return 1 if self.averager is None else self.averager.num_levels + 1

    @property
    def phase(self) -> jax.Array:
        """This state's phase: the level of this call (0: no average), an int32 scalar
        derived from the counters alone (the same on every replica).

        Example:
          >>> import lsgd_jax
          >>> int(lsgd_jax.PeriodicModelAverager(4, warmup_steps=1).init().phase)
          0
        """
        if self.averager is None:
            return jnp.zeros([], jnp.int32)
        return self.averager._level(self)

    def replace(self, **changes: Any) -> ModelAveragerState:
        """Returns a copy with the given fields replaced.

        Args:
          **changes: new values by field name, e.g. ``step=...``.

        Returns:
          A new ModelAveragerState.

        Example:
          >>> import jax.numpy as jnp, lsgd_jax
          >>> s = lsgd_jax.PeriodicModelAverager(4).init().replace(step=jnp.int32(9))
          >>> int(s.step)
          9
        """
        return dataclasses.replace(self, **changes)


def _check_state(state: Any, what: str, averager: Any) -> None:
    if not isinstance(state, ModelAveragerState):
        raise TypeError(
            f"{what} expects a ModelAveragerState (from averager.init()), got "
            f"{type(state).__name__}."
        )
    if state.averager is not None and state.averager != averager:
        raise ValueError(
            f"{what}: this state belongs to {state.averager!r}, not to {averager!r}; "
            "use the state that this averager's init() made."
        )
    if averager.needs_params and state.anchor is None:
        raise ValueError(
            f"{what}: {type(averager).__name__} with outer_optimizer or delta keeps the "
            "params of the last global average in its state; create the state with "
            "averager.init(params)."
        )


def _cast_like(tree: Any, like: Any) -> Any:
    """``tree`` with the dtypes and varying-axes types of ``like`` (cond branches agree)."""
    return jax.tree.map(
        lambda x, y: _collectives.cast_varying(jnp.asarray(x).astype(y.dtype), _collectives.vma(y)),
        tree,
        like,
    )


def _select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """``jnp.where(pred, a, b)`` leaf by leaf, for a scalar ``pred``."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def _delta_of(values: Any, anchor: Any) -> Any:
    """``values - anchor`` on the floating leaves (integer leaves pass)."""
    return jax.tree.map(lambda v, a: v - a if _collectives.is_averaged(v) else v, values, anchor)


def _undelta(anchor: Any, mean: Any, values: Any) -> Any:
    """``anchor + mean`` on the floating leaves; integer leaves keep ``values``."""
    return jax.tree.map(
        lambda a, m, v: a + m if _collectives.is_averaged(v) else v, anchor, mean, values
    )


INT32_MAX = int(np.iinfo(np.int32).max)


def _counter_overflow(name: str, step: Any) -> None:
    raise OverflowError(
        f"{name}: the averager's step counter reached the int32 maximum ({int(step)} calls) "
        "and its schedule (a callable period, or periods whose cycle is longer than the "
        "counter's range) cannot be followed past it. Restore from a checkpoint with the "
        "state's step (and last_sync) moved back by the same amount, e.g. state.replace("
        "step=state.step - k, last_sync=state.last_sync - k)."
    )


class _Averager:
    """What both averagers share: options, state, and the branch machinery.

    ``level(step)`` is 0 on steps that do not average, otherwise ``k`` (1-based): the
    k-th group of ``groups`` (or, with fragments, the k-th fragment).
    """

    warmup_steps: int
    nonfinite: str
    outer_optimizer: Any
    outer_skip_first: bool
    communication_dtype: Any
    delta: bool

    # -- configuration ----------------------------------------------------------------

    def _check_options(self) -> None:
        _check_nonfinite(self.nonfinite)
        if self.outer_optimizer is not None and not hasattr(self.outer_optimizer, "update"):
            raise TypeError(
                f"outer_optimizer must be an optax GradientTransformation, got "
                f"{self.outer_optimizer!r}; e.g. optax.sgd(0.7, momentum=0.9, nesterov=True)."
            )
        for flag in ("delta", "outer_skip_first"):
            object.__setattr__(self, flag, _validate.boolean(getattr(self, flag), flag))
        if self.communication_dtype is not None:
            dtype = jnp.dtype(self.communication_dtype)
            if not jnp.issubdtype(dtype, jnp.floating):
                raise ValueError(
                    f"communication_dtype must be a floating dtype such as jnp.bfloat16, "
                    f"got {self.communication_dtype!r}."
                )
            object.__setattr__(self, "communication_dtype", dtype)
            if self.nonfinite != "propagate":
                raise ValueError(
                    "communication_dtype works with nonfinite='propagate' only; the "
                    f"finiteness check needs the exact all-reduce (got {self.nonfinite!r})."
                )

    @property
    def needs_params(self) -> bool:
        """Whether ``init`` needs the params (outer optimizer or delta averaging)."""
        return self.outer_optimizer is not None or self.delta

    @property
    def groups(self) -> tuple[Group | None, ...]:
        raise NotImplementedError

    @property
    def num_levels(self) -> int:
        """How many nonzero levels ``level`` / ``schedule`` can return.

        Example:
          >>> import lsgd_jax
          >>> lsgd_jax.PeriodicModelAverager(8, fragments=4).num_levels
          4
        """
        return len(self.groups)

    def is_global(self, level: int) -> bool:
        """Whether an average at ``level`` spans the global group (crosses every node).

        Args:
          level: a level from ``level`` or ``schedule`` (0: no average).

        Returns:
          True for the last group's level (every fragment, with fragments).

        Example:
          >>> import lsgd_jax
          >>> avg = lsgd_jax.HierarchicalModelAverager({2: "local", 8: ("node", "local")})
          >>> [avg.is_global(k) for k in range(3)]
          [False, False, True]
        """
        return level == self.num_levels if len(self.groups) > 1 else level > 0

    def level(self, step: Any) -> Any:
        raise NotImplementedError

    def _level(self, state: ModelAveragerState) -> jax.Array:
        """The level of the current call, from the state's counters only."""
        return jnp.asarray(self.level(state.step), jnp.int32)

    def _resolve_groups(self) -> tuple[Group, ...]:
        raise NotImplementedError

    def _branch_groups(self) -> list[tuple[Group, Callable[[Any], Any] | None, bool]]:
        """One (group, leaf selector or None, is_global) per nonzero level."""
        groups = self._resolve_groups()
        return [(g, None, k == len(groups) - 1) for k, g in enumerate(groups)]

    # -- state ------------------------------------------------------------------------

    def init(self, params: Any = None) -> ModelAveragerState:
        """Returns the initial state: ``step == 0`` (and the anchor, where needed).

        Args:
          params: the initial params; required with ``outer_optimizer`` or ``delta``
            (the anchor of the first global average), ignored otherwise.

        Returns:
          A ModelAveragerState.

        Example:
          >>> import lsgd_jax
          >>> int(lsgd_jax.PeriodicModelAverager(4).init().step)
          0
        """
        state = ModelAveragerState(step=jnp.zeros([], jnp.int32), averager=self)
        if self.needs_params:
            if params is None:
                raise ValueError(
                    f"{type(self).__name__} with outer_optimizer or delta needs the initial "
                    "params: call averager.init(params)."
                )
            anchor = jax.tree.map(jnp.asarray, params)
            state = state.replace(anchor=anchor)
            if self.outer_optimizer is not None:
                state = state.replace(
                    outer_state=self.outer_optimizer.init(anchor),
                    outer_count=jnp.zeros([], jnp.int32),
                )
        if self._tracks_last_sync:
            state = state.replace(last_sync=jnp.zeros([], jnp.int32))
        return state

    @property
    def _tracks_last_sync(self) -> bool:
        """A period schedule (a callable period) needs the step of the last average."""
        return callable(getattr(self, "period", None))

    def schedule(self, num_steps: int) -> np.ndarray:
        """The level of every call from step 0 to ``num_steps - 1``, as a numpy array.

        Works for every option (a callable period included), so it is the way to count
        averages, e.g. ``sum(map(avg.is_global, avg.schedule(1000)))`` global ones.

        Args:
          num_steps: how many calls.

        Returns:
          An int array of levels (0: no average).

        Example:
          >>> import lsgd_jax
          >>> lsgd_jax.PeriodicModelAverager(3, warmup_steps=1).schedule(8).tolist()
          [0, 1, 0, 0, 1, 0, 0, 1]
        """
        return np.array([self.level(s) for s in range(num_steps)], np.int32)

    @property
    def cycle(self) -> int | None:
        """The length of the schedule's cycle after the warm-up (None: no cycle).

        The level at step ``s >= warmup_steps`` equals the level at ``s + cycle``: the
        period (periodic), the least common multiple of the periods (hierarchical), or
        None for a callable period.

        Example:
          >>> import lsgd_jax
          >>> lsgd_jax.HierarchicalModelAverager({4: "local", 6: ("node", "local")}).cycle
          12
        """
        raise NotImplementedError

    def _advance(self, state: ModelAveragerState) -> ModelAveragerState:
        """The state after one more call: ``step + 1``, kept inside int32.

        At the int32 maximum the count continues from an earlier step with the same
        place in the schedule (a whole number of cycles back, never below the warm-up),
        so the averages stay on schedule forever. A schedule without such a cycle raises
        OverflowError at that call instead of drifting silently.
        """
        step, cycle, warmup = state.step, self.cycle, self.warmup_steps
        span = INT32_MAX + 1 - warmup
        if cycle is not None and cycle <= span:
            wrapped = INT32_MAX + 1 - cycle * (span // cycle)
            nxt = jnp.where(step == INT32_MAX, jnp.int32(wrapped), step + (step < INT32_MAX))
            return state.replace(step=nxt.astype(jnp.int32))
        at_max = step == INT32_MAX
        name = type(self).__name__
        lax.cond(
            at_max,
            lambda: jax.debug.callback(functools.partial(_counter_overflow, name), step),
            lambda: None,
        )
        return state.replace(step=optax.safe_increment(step))

    # -- averaging --------------------------------------------------------------------

    def _mean(
        self, tree: Any, group: Group, step: jax.Array, cast: bool = True
    ) -> tuple[Any, jax.Array | None]:
        """The group mean of ``tree`` under this averager's dtype and non-finite policy.

        Returns ``(averaged, skipped)``: ``skipped`` is None when the policy never skips
        (a static fact), else a bool scalar, the same on every replica of the group, that
        says this group kept its own values ("skip" with a non-finite replica, "exclude"
        with no finite one); ``averaged`` is then ``tree`` itself.
        """
        if self.communication_dtype is not None:
            return _collectives.compressed_mean(tree, group, self.communication_dtype, cast), None
        if self.nonfinite == "propagate":
            return _collectives.mean(tree, group, cast), None
        averaged, excluded, finite = _collectives.finite_mean(tree, group, cast)
        if self.nonfinite == "skip":
            skipped = excluded > 0
        else:
            skipped = excluded >= _collectives.group_size(group)
        averaged = _select(skipped, tree, averaged)
        if logger.isEnabledFor(logging.WARNING):  # else no host callback in the program
            axes = _collectives.bound_axes()
            replica = lax.axis_index(axes) if axes else jnp.zeros([], jnp.int32)
            lax.cond(
                finite,
                lambda: None,
                lambda: jax.debug.callback(
                    functools.partial(_log_nonfinite, self.nonfinite), step, replica, excluded
                ),
            )
        return averaged, skipped

    def _outer_step(
        self, mean_p: Any, anchor: Any, state: ModelAveragerState, skipped: jax.Array | None
    ) -> tuple[Any, ModelAveragerState]:
        """The outer optimizer's step from ``anchor`` on the pseudo-gradient to the mean.

        Floating leaves only (integer ones keep ``mean_p``, their own value); a skipped
        average leaves the outer state and count as they were.
        """
        pseudo_grad = jax.tree.map(jnp.subtract, anchor, mean_p)
        updates, outer_state = self.outer_optimizer.update(pseudo_grad, state.outer_state, anchor)
        # anchor + updates, written so that sgd(1.0) gives the mean exactly:
        # updates == -pseudo_grad then, so pseudo_grad + updates == 0.
        stepped = jax.tree.map(
            lambda m, g, u: m + (g + u) if _collectives.is_averaged(m) else m,
            mean_p,
            pseudo_grad,
            updates,
        )
        outer_state = _cast_like(outer_state, state.outer_state)
        if self.outer_skip_first:  # the first global average only sets the anchor
            first = state.outer_count == 0
            stepped = _select(first, mean_p, stepped)
            outer_state = _select(first, state.outer_state, outer_state)
        count = optax.safe_increment(state.outer_count)
        if skipped is not None:
            outer_state = _select(skipped, state.outer_state, outer_state)
            count = jnp.where(skipped, state.outer_count, count)
        return stepped, state.replace(outer_state=outer_state, outer_count=count)

    def _average(
        self, params: Any, extra: Any, state: ModelAveragerState, branch: tuple
    ) -> tuple[Any, Any, ModelAveragerState]:
        """One level's average of ``params`` (and ``extra`` leaves, same collective)."""
        group, fragment, is_global = branch
        anchor = state.anchor
        cut = fragment.cut(params) if fragment is not None else _WHOLE
        p_in, e_in = cut.take(params), cut.take_aligned(extra, params)
        a_in = cut.take(anchor) if anchor is not None else None
        x = _delta_of(p_in, a_in) if self.delta else p_in
        # Uncast means: a global mean is invariant, so it can become a replicated anchor.
        (mean_x, mean_e), skipped = self._mean((x, e_in), group, state.step, cast=False)
        new_p = _undelta(a_in, mean_x, p_in) if self.delta else mean_x
        if is_global and self.outer_optimizer is not None:
            new_p, state = self._outer_step(new_p, a_in, state, skipped)
        if skipped is not None:  # a skipped average changes nothing but the step
            new_p, mean_e = _select(skipped, p_in, new_p), _select(skipped, e_in, mean_e)
        if is_global and anchor is not None:
            new_anchor = _cast_like(cut.put(anchor, new_p), anchor)
            if skipped is not None:
                new_anchor = _select(skipped, anchor, new_anchor)
            state = state.replace(anchor=new_anchor)
        new_p, mean_e = cut.put(params, new_p), cut.put_aligned(extra, params, mean_e)
        new_p, mean_e = _cast_like(new_p, params), _cast_like(mean_e, extra)
        if self._tracks_last_sync:  # the schedule's record: skipped or not, all agree
            state = state.replace(last_sync=state.step)
        return new_p, mean_e, state

    def _apply(self, operand: Any, state: ModelAveragerState, prepare, finish, passthrough):
        """The one cond/switch: ``finish(average(prepare(operand)))`` or ``passthrough``.

        ``prepare(operand) -> (params, extra)`` and ``finish(operand, params, extra) ->
        result`` run inside the averaging branches only; ``passthrough(operand) ->
        result`` is the branch of the steps that do not average.
        """
        branches_spec = self._branch_groups()

        def skip(op, st):
            return passthrough(op), st

        def make(branch):
            def run(op, st):
                params, extra = prepare(op)
                params, extra, st2 = self._average(params, extra, st, branch)
                return finish(op, params, extra), _cast_like(st2, st)

            return run

        branches = [skip] + [make(b) for b in branches_spec]
        return self._dispatch("model_averaging", state, branches, operand, state)

    def average_alongside(self, tree: Any, state: ModelAveragerState) -> Any:
        """The plain group mean of ``tree`` on the steps (and groups) that ``state`` averages.

        For values that follow the params but are not part of them, such as batch-norm
        statistics: call it with the averager state of the same step (before it was
        advanced). No anchor, outer optimizer or fragments apply; the step is not advanced.

        Args:
          tree: the pytree to average.
          state: the averager's state at this step.

        Returns:
          The averaged (or unchanged) tree.

        Example:
          >>> import jax, jax.numpy as jnp, lsgd_jax
          >>> from jax.sharding import PartitionSpec as P
          >>> mesh = lsgd_jax.make_mesh(num_nodes=2, devices_per_node=2)
          >>> avg = lsgd_jax.PeriodicModelAverager(period=2)
          >>> f = jax.jit(jax.shard_map(avg.average_alongside, mesh=mesh,
          ...     in_specs=(P(("node", "local")), P()), out_specs=P(("node", "local"))))
          >>> f(jnp.arange(4.0), avg.init())
          Array([1.5, 1.5, 1.5, 1.5], dtype=float32)
        """
        branches = [lambda t: t] + [
            functools.partial(lambda t, g: self._mean(t, g, state.step)[0], g=group)
            for group, _, _ in self._branch_groups()
        ]
        return self._dispatch("model_state_averaging", state, branches, tree)

    def _dispatch(self, scope: str, state: ModelAveragerState, branches: list, *operands):
        """Runs the branch of this step's level: the pinned one when a step specialized
        per phase pinned it (static), else one ``lax.cond`` / ``lax.switch``."""
        with jax.named_scope(scope):  # names the collectives in the HLO
            if state.pinned_phase is not None:
                return branches[state.pinned_phase](*operands)
            level = state.phase
            if len(branches) == 2:
                return lax.cond(level > 0, branches[1], branches[0], *operands)
            return lax.switch(level, branches, *operands)

    def average_parameters(
        self, params: Any, state: ModelAveragerState
    ) -> tuple[Any, ModelAveragerState]:
        """Replaces ``params`` by their group mean on averaging steps; advances the step.

        The exact path: on an averaging step each replica's params become the group mean
        itself, so the replicas of a group are bitwise identical afterwards. Call it after
        ``optax.apply_updates``, inside ``jax.shard_map`` or ``jax.pmap``.

        Args:
          params: this replica's parameters (any pytree; only floating leaves average).
          state: the averager's state, from ``init()``; the same on every replica.

        Returns:
          ``(params, new_state)``.

        Example:
          >>> import jax, jax.numpy as jnp, lsgd_jax
          >>> from jax.sharding import PartitionSpec as P
          >>> mesh = lsgd_jax.make_mesh(num_nodes=2, devices_per_node=2)
          >>> avg = lsgd_jax.PeriodicModelAverager(period=2)
          >>> f = jax.jit(jax.shard_map(avg.average_parameters, mesh=mesh,
          ...     in_specs=(P(("node", "local")), P()), out_specs=(P(("node", "local")), P())))
          >>> p, s = f(jnp.arange(4.0), avg.init())   # step 0 averages
          >>> p, int(s.step)
          (Array([1.5, 1.5, 1.5, 1.5], dtype=float32), 1)
        """
        return self.average_tree(params, None, state)[::2]

    def average_tree(
        self, params: Any, extra: Any, state: ModelAveragerState
    ) -> tuple[Any, Any, ModelAveragerState]:
        """Like ``average_parameters``, also averaging ``extra`` in the same collective.

        ``extra`` (e.g. momentum buffers, batch-norm statistics) is averaged on the same
        steps, over the same group, with the same all-reduce as the params, but takes no
        part in the options that concern the model (anchor, outer optimizer, delta).

        Args:
          params: this replica's parameters.
          extra: any pytree to average alongside (None for nothing).
          state: the averager's state.

        Returns:
          ``(params, extra, new_state)``.

        Example:
          >>> import jax, jax.numpy as jnp, lsgd_jax
          >>> from jax.sharding import PartitionSpec as P
          >>> mesh = lsgd_jax.make_mesh(num_nodes=2, devices_per_node=2)
          >>> avg = lsgd_jax.PeriodicModelAverager(period=2)
          >>> D = P(("node", "local"))
          >>> f = jax.jit(jax.shard_map(avg.average_tree, mesh=mesh,
          ...     in_specs=(D, D, P()), out_specs=(D, D, P())))
          >>> p, m, s = f(jnp.arange(4.0), 10 * jnp.arange(4.0), avg.init())
          >>> m
          Array([15., 15., 15., 15.], dtype=float32)
        """
        _check_state(state, "average_parameters", self)
        (params, extra), state = self._apply(
            (params, extra),
            state,
            prepare=lambda op: op,
            finish=lambda op, p, e: (p, e),
            passthrough=lambda op: op,
        )
        return params, extra, self._advance(state)


@dataclasses.dataclass(frozen=True)
class _Fragment:
    """The k-th of K equal slices of the params' floating values, in flattened order.

    ``cut(params)`` fixes the slices for one params tree: a leaf may be cut between two
    fragments.
    """

    k: int
    count: int

    def cut(self, params: Any) -> _Cut:
        """The ``(leaf index, lo, hi)`` slices of ``params``'s raveled leaves in this
        fragment, as a :class:`_Cut`."""
        leaves = jax.tree.leaves(params)
        sizes = [
            (i, int(np.prod(jnp.shape(x))))
            for i, x in enumerate(leaves)
            if _collectives.is_averaged(x)
        ]
        total = sum(n for _, n in sizes)
        if total and total < self.count:
            raise ValueError(
                f"fragments={self.count} needs at least that many floating values to split, "
                f"got {total}; use fewer fragments."
            )
        chunk = -(-total // self.count)
        start, end = self.k * chunk, min((self.k + 1) * chunk, total)
        pieces, offset = [], 0
        for i, n in sizes:
            lo, hi = max(start, offset), min(end, offset + n)
            if lo < hi:
                pieces.append((i, lo - offset, hi - offset))
            offset += n
        return _Cut(tuple(pieces), jax.tree.structure(params), _shapes(params))


def _shapes(tree: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(jnp.shape(x) for x in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class _Cut:
    """Static slices of a params-shaped tree: what one fragment averages.

    ``take`` returns the flat pieces, ``put`` writes new values into exactly those
    positions (static slices: the other elements are untouched). ``take_aligned`` /
    ``put_aligned`` do the same inside a tree that holds params-shaped parts (an
    optimizer state's momentum, Adam's moments): those parts are cut like the params,
    so element i of a moment is averaged on the step its param element i is; any other
    leaf is taken whole.
    """

    pieces: tuple[tuple[int, int, int], ...]
    treedef: Any
    shapes: tuple[tuple[int, ...], ...]

    def take(self, tree: Any) -> list[Any]:
        leaves = jax.tree.leaves(tree)
        return [jnp.ravel(leaves[i])[lo:hi] for i, lo, hi in self.pieces]

    def put(self, tree: Any, values: list[Any]) -> Any:
        leaves, treedef = jax.tree.flatten(tree)
        for (i, lo, hi), v in zip(self.pieces, values):
            x = leaves[i]
            flat = jnp.ravel(x).at[lo:hi].set(v.astype(x.dtype))
            leaves[i] = _collectives.cast_varying(flat.reshape(x.shape), _collectives.vma(x))
        return jax.tree.unflatten(treedef, leaves)

    def _shaped(self, node: Any) -> bool:
        return jax.tree.structure(node) == self.treedef and _shapes(node) == self.shapes

    def take_aligned(self, tree: Any, params: Any) -> Any:
        del params  # the cut already holds the params' layout
        if tree is None:
            return None
        nodes = jax.tree.leaves(tree, is_leaf=self._shaped)
        return [self.take(n) if self._shaped(n) else n for n in nodes]

    def put_aligned(self, tree: Any, params: Any, values: Any) -> Any:
        del params
        if tree is None:
            return None
        nodes, treedef = jax.tree.flatten(tree, is_leaf=self._shaped)
        new = [self.put(n, v) if self._shaped(n) else v for n, v in zip(nodes, values)]
        return jax.tree.unflatten(treedef, new)


class _Whole:
    """The cut of an average without fragments: everything, as it is."""

    def take(self, tree: Any) -> Any:
        return tree

    def put(self, tree: Any, values: Any) -> Any:
        del tree
        return values

    def take_aligned(self, tree: Any, params: Any) -> Any:
        del params
        return tree

    def put_aligned(self, tree: Any, params: Any, values: Any) -> Any:
        del tree, params
        return values


_WHOLE = _Whole()


def _options() -> dict[str, Any]:
    return {
        "nonfinite": dataclasses.field(default="propagate", kw_only=True),
        "outer_optimizer": dataclasses.field(default=None, kw_only=True),
        "outer_skip_first": dataclasses.field(default=True, kw_only=True),
        "communication_dtype": dataclasses.field(default=None, kw_only=True),
        "delta": dataclasses.field(default=False, kw_only=True),
    }


@dataclasses.dataclass(frozen=True)
class PeriodicModelAverager(_Averager):
    """Averages the model over a group every ``period`` steps after a warm-up.

    The JAX form of PyTorch's ``PeriodicModelAverager``: a call at step ``s`` (counted
    from 0) averages when ``s >= warmup_steps`` and ``(s - warmup_steps) % period == 0``,
    so the first average happens at step ``warmup_steps`` itself. With
    :func:`post_local_sgd`, set ``warmup_steps == start_localSGD_iter``.

    An immutable, hashable config; the step counter lives in the state from ``init()``.
    Every option below is off by default, which is PyTorch's behaviour exactly.

    Args:
      period: steps between averages (>= 1; 1 warns, as plain DDP is then cheaper); or
        a schedule ``period(step) -> int`` (jit-able, e.g. ``lambda s: jnp.where(s <
        1000, 16, 4)``): the average at step ``s`` happens when ``s == warmup_steps`` or
        ``s - last_average >= period(s)`` (AdaComm-style: Wang & Joshi, "Adaptive
        Communication Strategies to Achieve the Best Error-Runtime Trade-off in Local-Update
        SGD", SysML 2019). For a constant schedule this is the same rule.
      warmup_steps: steps before the first average (>= 0).
      process_group: the axes to average over; None: every mapped axis bound where it runs.
      fragments: split the params into this many equal slices of their flattened values
        and average one slice at a time, round robin, each every ``period`` steps, the
        k-th offset by ``k * period / fragments`` steps: the peak cross-node traffic per
        step drops ``fragments`` times (Streaming DiLoCo, Douillard et al., 2025).
        ``period`` must be an int divisible by ``fragments``. With ``delta`` or an
        anchor, each fragment's anchor is that fragment at its own last average.
        Optimizer-state leaves averaged alongside (``post_local_sgd_optimizer``'s
        ``average_opt_state``) that form a params-shaped part of the state (momentum,
        Adam's moments) are cut like the params; other leaves, and model state, are
        averaged whole at every fragment's average.{options}
    Example:
      >>> import lsgd_jax
      >>> avg = lsgd_jax.PeriodicModelAverager(period=4, warmup_steps=2)
      >>> [s for s in range(12) if avg.level(s)]
      [2, 6, 10]

    References:
      Lin, Stich, Patel, Jaggi, `Don't Use Large Mini-Batches, Use Local SGD
      <https://arxiv.org/abs/1808.07217>`_, ICLR 2020.
    """

    period: int | Callable[[jax.Array], Any]
    warmup_steps: int = 0
    process_group: GroupSpec = None
    fragments: int = dataclasses.field(default=1, kw_only=True)
    nonfinite: str = _options()["nonfinite"]
    outer_optimizer: Any = _options()["outer_optimizer"]
    outer_skip_first: bool = _options()["outer_skip_first"]
    communication_dtype: Any = _options()["communication_dtype"]
    delta: bool = _options()["delta"]

    def __post_init__(self) -> None:
        self._check_options()
        if not callable(self.period):
            object.__setattr__(self, "period", _validate.positive_int(self.period, "period"))
            if self.period == 1:
                warnings.warn(_PERIOD_ONE, stacklevel=3)
        object.__setattr__(
            self, "warmup_steps", _validate.nonnegative_int(self.warmup_steps, "warmup_steps")
        )
        object.__setattr__(
            self,
            "process_group",
            _collectives.normalize_group(self.process_group, "process_group"),
        )
        k = _validate.positive_int(self.fragments, "fragments")
        if k > 1:
            if callable(self.period) or self.period % k:
                raise ValueError(
                    f"fragments={k} needs an int period divisible by it, got period="
                    f"{self.period!r}; e.g. period={4 * k}."
                )
            if self.outer_optimizer is not None:
                raise ValueError(
                    "fragments with an outer_optimizer is not supported; use one or the other."
                )

    @property
    def groups(self) -> tuple[Group | None, ...]:
        return (self.process_group,)

    @property
    def cycle(self) -> int | None:  # type: ignore[override]
        return None if callable(self.period) else self.period

    @property
    def num_levels(self) -> int:  # type: ignore[override]
        return self.fragments

    def level(self, step: Any) -> Any:
        """Which call averages: 0 for none, else 1 (or the fragment number, 1-based).

        Args:
          step: the averager's step count (Python int or int array).

        Returns:
          The level, of the same kind as ``step``.

        Example:
          >>> import lsgd_jax
          >>> [lsgd_jax.PeriodicModelAverager(2, warmup_steps=1).level(s) for s in range(5)]
          [0, 1, 0, 1, 0]
          >>> [lsgd_jax.PeriodicModelAverager(4, fragments=2).level(s) for s in range(6)]
          [1, 0, 2, 0, 1, 0]
        """
        if callable(self.period):
            raise TypeError(
                "With a period schedule the level depends on the last average, not on the "
                "step alone: use averager.schedule(num_steps)."
            )
        stride = self.period // self.fragments
        after = step - self.warmup_steps
        on = (step >= self.warmup_steps) & (after % stride == 0)
        which = (after // stride) % self.fragments + 1
        if isinstance(on, jax.Array) or isinstance(step, jax.Array):
            return jnp.where(on, which, 0).astype(jnp.int32)
        return int(which) if on else 0

    def _level(self, state: ModelAveragerState) -> jax.Array:
        if not callable(self.period):
            return super()._level(state)
        step = state.step
        period = jnp.asarray(self.period(step), jnp.int32)
        on = (step == self.warmup_steps) | (step - state.last_sync >= period)
        return ((step >= self.warmup_steps) & on).astype(jnp.int32)

    def schedule(self, num_steps: int) -> np.ndarray:
        if not callable(self.period):
            return super().schedule(num_steps)
        out, last = [], 0
        for s in range(num_steps):
            hit = s >= self.warmup_steps and (
                s == self.warmup_steps or s - last >= int(self.period(jnp.int32(s)))
            )
            out.append(int(hit))
            last = s if hit else last
        return np.array(out, np.int32)

    schedule.__doc__ = _Averager.schedule.__doc__

    def _resolve_groups(self) -> tuple[Group, ...]:
        what = "PeriodicModelAverager"
        return (_collectives.resolve(self.process_group, _collectives.global_axes(what), what),)

    def _branch_groups(self) -> list[tuple[Group, Any, bool]]:
        (group,) = self._resolve_groups()
        if self.fragments == 1:
            return [(group, None, True)]
        return [(group, _Fragment(k, self.fragments), True) for k in range(self.fragments)]


PeriodicModelAverager.__doc__ = PeriodicModelAverager.__doc__.format(options=_OPTIONS_DOC)


@dataclasses.dataclass(frozen=True)
class HierarchicalModelAverager(_Averager):
    """Averages over nested groups, each at its own period (e.g. node, pod, world).

    The JAX form of PyTorch's ``HierarchicalModelAverager``: a call at step ``s`` with
    ``s >= warmup_steps`` takes the LARGEST period with ``s % period == 0`` (``s``, not
    ``s - warmup_steps``, unlike the periodic averager) and averages over that period's
    group only. At most one group's collective runs per step (one ``lax.switch``).

    Args:
      period_group_dict: maps each period to its group's mesh axes (an axis name, a tuple
        of names, or an IndexGroups), smallest period and group first; groups nested;
        the last one the global axes (or None for every bound mapped axis).
      warmup_steps: steps before the first average (>= 0).
      process_group: the global axes, to check the last group against at construction;
        None: checked where it runs, against every bound mapped axis.
      nonfinite, outer_optimizer, communication_dtype, delta: as for
        PeriodicModelAverager; the outer optimizer acts at the global (last) level, and
        the anchor is the params at the last global average.

    Example:
      >>> import lsgd_jax
      >>> avg = lsgd_jax.HierarchicalModelAverager(
      ...     {2: "local", 4: ("node", "local")}, warmup_steps=2)
      >>> [avg.level(s) for s in range(9)]
      [0, 0, 1, 0, 2, 0, 1, 0, 2]
    """

    period_group_dict: Mapping[int, GroupSpec]
    warmup_steps: int = 0
    process_group: GroupSpec = None
    nonfinite: str = _options()["nonfinite"]
    outer_optimizer: Any = _options()["outer_optimizer"]
    outer_skip_first: bool = _options()["outer_skip_first"]
    communication_dtype: Any = _options()["communication_dtype"]
    delta: bool = _options()["delta"]

    def __post_init__(self) -> None:
        self._check_options()
        d = self.period_group_dict
        if not isinstance(d, Mapping) or not d:
            raise ValueError(
                f"period_group_dict must be a non-empty dict of period -> group axes, got "
                f"{d!r}; e.g. {{4: 'local', 16: ('node', 'local')}}."
            )
        periods = [_validate.positive_int(p, f"period {p!r} in period_group_dict") for p in d]
        if any(b <= a for a, b in zip(periods, periods[1:])):
            raise ValueError(
                f"The periods of period_group_dict must be strictly increasing (smallest "
                f"group first), got {periods}; order the dict by period."
            )
        groups = [_collectives.normalize_group(g, f"group of period {p}") for p, g in d.items()]
        if None in groups[:-1]:
            raise ValueError(
                "Only the last (global) group of period_group_dict may be None; name the "
                f"axes of the others, got {dict(zip(periods, groups))}."
            )
        object.__setattr__(self, "period_group_dict", tuple(zip(periods, groups)))
        object.__setattr__(
            self, "warmup_steps", _validate.nonnegative_int(self.warmup_steps, "warmup_steps")
        )
        pg = _collectives.normalize_group(self.process_group, "process_group")
        object.__setattr__(self, "process_group", pg)
        self._check_groups(groups, pg)
        if periods[-1] == 1:
            warnings.warn(_PERIOD_ONE, stacklevel=3)
        logger.info("Model averaging hierarchy:")
        for p, g in zip(periods, groups):
            logger.info(
                "\tEach group over axes %s averages parameters every %s iterations, if no "
                "higher-level averaging.",
                g if g is not None else "(all)",
                p,
            )

    @staticmethod
    def _check_groups(groups: list[Group | None], global_group: Group | None) -> None:
        for small, big in zip(groups, groups[1:]):
            if small is not None and big is not None and not _collectives.group_covers(small, big):
                raise ValueError(
                    f"The groups of period_group_dict must be nested (each inside the next), "
                    f"but {small!r} is not inside {big!r}."
                )
        last = groups[-1]
        covers = _collectives.group_covers
        if global_group is not None and last is not None:
            if not (covers(last, global_group) and covers(global_group, last)):  # same group
                raise ValueError(
                    f"The last group of period_group_dict must be the global group "
                    f"{global_group!r}, got {last!r}; add a level for the global axes (when "
                    "the shard_map is also manual over a model axis, pass "
                    "process_group=<the data axes>)."
                )

    @property
    def periods(self) -> tuple[int, ...]:
        """The periods, in increasing order."""
        return tuple(p for p, _ in self.period_group_dict)

    @property
    def groups(self) -> tuple[Group | None, ...]:
        return tuple(g for _, g in self.period_group_dict)

    @property
    def cycle(self) -> int:  # type: ignore[override]
        return math.lcm(*self.periods)

    def level(self, step: Any) -> Any:
        """Which group a call at ``step`` averages: 0 for none, k for the k-th (1-based).

        Args:
          step: the averager's step count (int or int array).

        Returns:
          The level, of the same kind as ``step``.

        Example:
          >>> import lsgd_jax
          >>> avg = lsgd_jax.HierarchicalModelAverager({1: "local", 3: ("node", "local")})
          >>> [avg.level(s) for s in range(4)]
          [2, 1, 1, 2]
        """
        if isinstance(step, jax.Array) or not isinstance(step, int):
            step = jnp.asarray(step)
            level = jnp.zeros_like(step, dtype=jnp.int32)
            for k, p in enumerate(self.periods, start=1):
                level = jnp.where(step % p == 0, k, level)  # the largest period wins
            return jnp.where(step >= self.warmup_steps, level, 0)
        if step < self.warmup_steps:
            return 0
        return max((k for k, p in enumerate(self.periods, 1) if step % p == 0), default=0)

    def _resolve_groups(self) -> tuple[Group, ...]:
        what = "HierarchicalModelAverager"
        default = _collectives.global_axes(what)
        global_group = self.process_group
        global_group = _collectives.resolve(global_group, default, what + " (process_group)")
        groups = [_collectives.resolve(g, lambda: global_group, what) for g in self.groups]
        self._check_groups(groups, global_group)
        return tuple(groups)


Averager = Union[PeriodicModelAverager, HierarchicalModelAverager]


Averager = Union[PeriodicModelAverager, HierarchicalModelAverager]


def check_averager(averager: Any, what: str) -> None:
    """Raises TypeError unless ``averager`` is one of ours."""
    if not isinstance(averager, _Averager):
        raise TypeError(
            f"{what} expects a PeriodicModelAverager or HierarchicalModelAverager, got "
            f"{averager!r}."
        )
