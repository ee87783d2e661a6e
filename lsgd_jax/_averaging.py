"""Model averagers (periodic, hierarchical) and their optax transformations."""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Union

import jax
import jax.numpy as jnp
import optax
from jax import lax

from lsgd_jax import _collectives
from lsgd_jax._collectives import Group, GroupSpec
from lsgd_jax._state import check_nonnegative_int, logger

_PERIOD_ONE = (
    "When period is 1, no need to use model averaging because the communication cost of "
    "all-reducing parameters will be no less than the cost of all-reducing gradients in "
    "the backward pass. Therefore, only plain data-parallel averaging of gradients should "
    "be used for this case."
)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["step"], meta_fields=["averager"])
@dataclasses.dataclass(frozen=True, eq=False)
class ModelAveragerState:
    """The state of a model averager: its step count, and (static) which averager.

    A pytree whose only array leaf is ``step``; ``averager`` is static metadata, so a
    training loop can tell from an optimizer state alone when, and over which group,
    the models were averaged (e.g. to average batch-norm statistics on the same steps).

    Attributes:
      step: int32 scalar, the number of ``average_parameters`` calls so far (PyTorch's
        ``averager.step``). It saturates at the int32 maximum instead of wrapping.
      averager: the PeriodicModelAverager or HierarchicalModelAverager that owns it.

    Example:
      >>> import lsgd_jax
      >>> state = lsgd_jax.PeriodicModelAverager(4).init()
      >>> int(state.step), state.averager.period
      (0, 4)
    """

    step: jax.Array
    averager: Any = None

    def replace(self, **changes: Any) -> ModelAveragerState:
        """Returns a copy with the given fields replaced.

        Args:
          **changes: ``step=...`` and/or ``averager=...``.

        Returns:
          A new ModelAveragerState.

        Example:
          >>> import jax.numpy as jnp, lsgd_jax
          >>> s = lsgd_jax.PeriodicModelAverager(4).init().replace(step=jnp.int32(9))
          >>> int(s.step)
          9
        """
        return dataclasses.replace(self, **changes)


def _check_period(period: Any, name: str) -> int:
    if isinstance(period, bool) or not isinstance(period, (int, jnp.integer)):
        raise TypeError(f"{name} must be a Python int, got {period!r}.")
    if period < 1:
        raise ValueError(f"{name} must be a positive value, got {period}; use 1 or more.")
    return int(period)


class _Averager:
    """What both averagers share: a step counter and a schedule of group levels.

    ``level(step)`` is 0 on steps that do not average, otherwise ``k`` (1-based) for the
    k-th group of ``groups``. ``average_parameters`` runs a ``lax.switch`` (a ``lax.cond``
    for a single group) on that level, so at most one group's collective runs per step.
    """

    groups: tuple[Group | None, ...]
    warmup_steps: int

    def level(self, step: Any) -> Any:
        raise NotImplementedError

    def _resolve_groups(self) -> tuple[Group, ...]:
        raise NotImplementedError

    def init(self) -> ModelAveragerState:
        """Returns the initial state: ``step == 0``.

        Returns:
          A ModelAveragerState.

        Example:
          >>> import lsgd_jax
          >>> int(lsgd_jax.PeriodicModelAverager(4).init().step)
          0
        """
        return ModelAveragerState(step=jnp.zeros([], jnp.int32), averager=self)

    def _mean(self, tree: Any, group: Group, step: jax.Array) -> Any:
        """The group mean of ``tree`` under this averager's non-finite policy."""
        if self.nonfinite == "propagate":
            return _collectives.mean(tree, group)
        averaged, excluded, finite = _collectives.finite_mean(tree, group)
        if self.nonfinite == "skip":
            averaged = jax.tree.map(
                lambda a, t: jnp.where(excluded > 0, t, a) if _collectives.is_averaged(t) else t,
                averaged,
                tree,
            )
        if not logger.isEnabledFor(logging.WARNING):
            return averaged  # no host callback in the program
        axes = _collectives.bound_axes()
        replica = lax.axis_index(axes) if axes else jnp.zeros([], jnp.int32)
        lax.cond(
            finite,
            lambda: None,
            lambda: jax.debug.callback(
                functools.partial(_log_nonfinite, self.nonfinite), step, replica, excluded
            ),
        )
        return averaged

    def _switch(self, step: jax.Array, branch: Callable[[Any, Group], Any], identity, operand):
        """Runs ``branch(operand, group)`` for the level of ``step``, else ``identity``."""
        groups = self._resolve_groups()
        branches = [identity] + [lambda op, g=g: branch(op, g) for g in groups]
        level = self.level(step)
        if len(branches) == 2:
            return lax.cond(level > 0, branches[1], branches[0], operand)
        return lax.switch(level, branches, operand)

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
        _check_state(state, "average_parameters", self)
        average = functools.partial(self._mean, step=state.step)
        params = self._switch(state.step, average, lambda p: p, params)
        return params, state.replace(step=optax.safe_increment(state.step))


NONFINITE_POLICIES = ("propagate", "exclude", "skip")


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


def _check_nonfinite(policy: Any) -> None:
    if policy not in NONFINITE_POLICIES:
        raise ValueError(
            f"nonfinite must be one of {NONFINITE_POLICIES}, got {policy!r}: 'propagate' "
            "(PyTorch's behaviour: a NaN spreads to the whole group), 'exclude' (average "
            "the finite replicas only) or 'skip' (no average for a group with a NaN)."
        )


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


@dataclasses.dataclass(frozen=True)
class PeriodicModelAverager(_Averager):
    """Averages the model over a group every ``period`` steps after a warm-up.

    The JAX form of PyTorch's ``PeriodicModelAverager``: a call at step ``s`` (counted
    from 0) averages when ``s >= warmup_steps`` and ``(s - warmup_steps) % period == 0``,
    so the first average happens at step ``warmup_steps`` itself. With
    :func:`post_local_sgd`, set ``warmup_steps == start_localSGD_iter``.

    An immutable, hashable config; the step counter lives in the state from ``init()``.

    Args:
      period: steps between averages (>= 1; 1 warns, as plain DDP is then cheaper).
      warmup_steps: steps before the first average (>= 0).
      process_group: the axes to average over; None: every mapped axis bound where it runs.
      nonfinite: what a replica with NaN/Inf params does to an average: ``"propagate"``
        (default, PyTorch's behaviour: the whole group becomes NaN), ``"exclude"`` (the
        mean of the finite replicas only, which the non-finite ones also receive:
        ``average_parameters`` heals them; through ``model_averaging`` a replica whose
        update is non-finite is healed, but one whose params already are stays so,
        since ``apply_updates`` adds to them, and cannot spread) or ``"skip"``
        (a group with a non-finite replica does not average this time). Either of the
        last two logs a warning naming the replica and step, through the ``"lsgd_jax"``
        logger (a host callback, compiled in while that logger is enabled for WARNING
        at trace time); still one collective per average.

    Example:
      >>> import lsgd_jax
      >>> avg = lsgd_jax.PeriodicModelAverager(period=4, warmup_steps=2)
      >>> [s for s in range(12) if avg.level(s)]
      [2, 6, 10]
    """

    period: int
    warmup_steps: int = 0
    process_group: GroupSpec = None
    nonfinite: str = dataclasses.field(default="propagate", kw_only=True)

    def __post_init__(self) -> None:
        _check_nonfinite(self.nonfinite)
        object.__setattr__(self, "period", _check_period(self.period, "period"))
        object.__setattr__(
            self, "warmup_steps", check_nonnegative_int(self.warmup_steps, "warmup_steps")
        )
        object.__setattr__(
            self,
            "process_group",
            _collectives.normalize_group(self.process_group, "process_group"),
        )
        if self.period == 1:
            warnings.warn(_PERIOD_ONE, stacklevel=3)

    @property
    def groups(self) -> tuple[Group | None, ...]:  # type: ignore[override]
        return (self.process_group,)

    def level(self, step: Any) -> Any:
        """1 if a call at ``step`` averages, else 0 (Python ints or JAX arrays).

        Args:
          step: the averager's step count (int or int array).

        Returns:
          0 or 1, of the same kind as ``step``.

        Example:
          >>> import lsgd_jax
          >>> [lsgd_jax.PeriodicModelAverager(2, warmup_steps=1).level(s) for s in range(5)]
          [0, 1, 0, 1, 0]
        """
        after = step - self.warmup_steps
        hit = (step >= self.warmup_steps) & (after % self.period == 0)
        return jnp.astype(hit, jnp.int32) if isinstance(hit, jax.Array) else int(hit)

    def _resolve_groups(self) -> tuple[Group, ...]:
        what = "PeriodicModelAverager"
        return (_collectives.resolve(self.process_group, _collectives.global_axes(what), what),)


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
      nonfinite: ``"propagate"``, ``"exclude"`` or ``"skip"``; see PeriodicModelAverager.

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
    nonfinite: str = dataclasses.field(default="propagate", kw_only=True)

    def __post_init__(self) -> None:
        _check_nonfinite(self.nonfinite)
        d = self.period_group_dict
        if not isinstance(d, Mapping) or not d:
            raise ValueError(
                f"period_group_dict must be a non-empty dict of period -> group axes, got "
                f"{d!r}; e.g. {{4: 'local', 16: ('node', 'local')}}."
            )
        periods = [_check_period(p, f"period {p!r} in period_group_dict") for p in d]
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
            self, "warmup_steps", check_nonnegative_int(self.warmup_steps, "warmup_steps")
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
        if global_group is not None and last is not None and last != global_group:
            if _collectives.group_axes(last) != _collectives.group_axes(global_group) or isinstance(
                last, _collectives.IndexGroups
            ):
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
    def groups(self) -> tuple[Group | None, ...]:  # type: ignore[override]
        return tuple(g for _, g in self.period_group_dict)

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


def _check_averager(averager: Any, what: str) -> None:
    if not isinstance(averager, _Averager):
        raise TypeError(
            f"{what} expects a PeriodicModelAverager or HierarchicalModelAverager, got "
            f"{averager!r}."
        )


def model_averaging(averager: Averager) -> optax.GradientTransformationExtraArgs:
    """Model averaging as the last transformation of an ``optax.chain``.

    On the steps where ``averager`` averages, the incoming updates ``u`` are replaced by
    ``mean(params + u) - params`` (the mean over the averager's group), so that
    ``optax.apply_updates`` moves every replica to the group mean; on other steps ``u``
    passes through unchanged, and the addition, the collective and the subtraction all
    sit inside the untaken branch of a ``lax.cond``/``lax.switch``.

    This path is exact only up to rounding: ``apply_updates`` adds ``params + (mean -
    params)``, which need not equal ``mean`` in floating point, so replicas can differ in
    the last bit after an average. For bitwise-identical replicas call
    ``averager.average_parameters(params, state)`` after ``optax.apply_updates`` instead.

    Args:
      averager: a PeriodicModelAverager or HierarchicalModelAverager.

    Returns:
      An optax.GradientTransformationExtraArgs whose state is a ModelAveragerState; its
      update requires ``params``.

    Example:
      >>> import optax, lsgd_jax
      >>> tx = optax.chain(
      ...     lsgd_jax.post_local_sgd(start_localSGD_iter=10),
      ...     optax.adamw(1e-3),
      ...     lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(4, warmup_steps=10)),
      ... )
    """
    _check_averager(averager, "model_averaging")

    def init_fn(params: optax.Params) -> ModelAveragerState:
        del params
        return averager.init()

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError(
                "model_averaging needs the current params: call "
                "tx.update(grads, opt_state, params) (optax's third argument)."
            )
        _check_state(state, "model_averaging", averager)

        def to_mean(operand, group):
            u, p = operand
            new = jax.tree.map(
                lambda pi, ui: jnp.asarray(pi + ui).astype(jnp.result_type(pi)), p, u
            )
            new = averager._mean(new, group, state.step)
            out = jax.tree.map(
                lambda ni, pi, ui: (
                    (ni - pi).astype(jnp.result_type(ui)) if _collectives.is_averaged(ui) else ui
                ),
                new,
                p,
                u,
            )
            return _collectives.cast_tree_like(out, u, p)

        def passthrough(operand):
            u, p = operand
            return _collectives.cast_tree_like(u, u, p)

        new_updates = averager._switch(state.step, to_mean, passthrough, (updates, params))
        return new_updates, state.replace(step=optax.safe_increment(state.step))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class PostLocalSGDOptimizerState(NamedTuple):
    """The state of :func:`post_local_sgd_optimizer`.

    Attributes:
      inner_state: the wrapped optimizer's state (never averaged).
      averager_state: the averager's ModelAveragerState; restoring it from a checkpoint
        keeps the averaging schedule (no second warm-up).
    """

    inner_state: optax.OptState
    averager_state: ModelAveragerState


def post_local_sgd_optimizer(
    optim: optax.GradientTransformation, averager: Averager
) -> optax.GradientTransformationExtraArgs:
    """The optax form of PyTorch's ``PostLocalSGDOptimizer``: step, then average.

    Runs ``optim``, then :func:`model_averaging` with ``averager`` on the result. Its
    state holds the inner optimizer's state (which is never averaged, as in PyTorch) and
    the averager's step, so a restored checkpoint resumes the averaging schedule instead
    of redoing the warm-up. Use it after :func:`post_local_sgd` in an ``optax.chain``.

    Args:
      optim: the local optimizer (any optax GradientTransformation).
      averager: a PeriodicModelAverager or HierarchicalModelAverager.

    Returns:
      An optax.GradientTransformationExtraArgs with a PostLocalSGDOptimizerState.

    Example:
      >>> import optax, lsgd_jax
      >>> tx = optax.chain(
      ...     lsgd_jax.post_local_sgd(start_localSGD_iter=100),
      ...     lsgd_jax.post_local_sgd_optimizer(
      ...         optax.sgd(0.1, momentum=0.9),
      ...         lsgd_jax.PeriodicModelAverager(period=4, warmup_steps=100)),
      ... )
    """
    _check_averager(averager, "post_local_sgd_optimizer")
    inner = optax.with_extra_args_support(optim)
    averaging = model_averaging(averager)

    def init_fn(params: optax.Params) -> PostLocalSGDOptimizerState:
        return PostLocalSGDOptimizerState(inner.init(params), averaging.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError(
                "post_local_sgd_optimizer needs the current params: call "
                "tx.update(grads, opt_state, params)."
            )
        updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        updates, averager_state = averaging.update(updates, state.averager_state, params)
        return updates, PostLocalSGDOptimizerState(inner_state, averager_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
