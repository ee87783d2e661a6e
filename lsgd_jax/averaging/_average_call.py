"""One call of an averager: the branch of this step's level, and that level's average.

A call takes one branch, the same on every replica since it comes from the state's
counters: "no average" (the values pass), or the average over one level's group (or one
fragment). Whoever specializes a step per phase pins the branch in the state's static
metadata; otherwise it is one ``lax.cond``/``lax.switch``. One level's average composes
the pieces that live elsewhere: the fragment's cut (``_fragments``), the change since the
anchor and the outer optimizer's step (``_outer``), the mean itself (the averager's
``lsgd_jax.comm`` strategy).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from lsgd_jax import comm
from lsgd_jax._core import _collectives
from lsgd_jax.averaging import _fragments, _offload, _outer
from lsgd_jax.averaging._averager_state import ModelAveragerState


def dispatch(scope: str, state: ModelAveragerState, branches: list, *operands: Any) -> Any:
    """Runs the branch of this step's level: the pinned one when a step specialized per
    phase pinned it (static), else one ``lax.cond`` / ``lax.switch`` on the counters.

    Example:
      >>> import jax.numpy as jnp, lsgd_jax
      >>> from lsgd_jax.averaging import _average_call
      >>> state = lsgd_jax.PeriodicModelAverager(2).init()   # step 0: level 1
      >>> _average_call.dispatch("demo", state, [lambda x: x, lambda x: 2 * x], jnp.ones(2))
      Array([2., 2.], dtype=float32)
    """
    with jax.named_scope(scope):  # names the collectives in the HLO
        if state.pinned_phase is not None:
            return branches[state.pinned_phase](*operands)
        level = state.phase
        if len(branches) == 2:
            return lax.cond(level > 0, branches[1], branches[0], *operands)
        return lax.switch(level, branches, *operands)


def average_level(
    averager: Any, params: Any, extra: Any, state: ModelAveragerState, branch: tuple
) -> tuple[Any, Any, ModelAveragerState]:
    """One level's average of ``params`` (and ``extra``, in the same collective).

    ``branch`` is ``(group, fragment or None, is_global)``. A skipped average (the
    strategy's ``skipped``) changes nothing but what the schedule records (and, while
    the replicas' anchors may still differ, makes the anchor common: see
    :func:`_anchor_in`); the state's ``skipped`` records it.
    """
    group, fragment, is_global = branch
    parts = averager.parts
    cut = fragment.cut(params) if fragment is not None else _fragments.WHOLE
    p_in, e_in = cut.take(params), cut.take_aligned(extra, params)
    a_in = _anchor_in(averager, state, cut, branch, p_in)
    x = parts.what.send(p_in, a_in)
    (mean_x, mean_e), skipped, state = _mean(averager, (x, e_in), cut, group, state)
    new_p = parts.what.receive(mean_x, a_in, p_in)
    new_p, state = parts.then.apply(new_p, a_in, state, skipped, is_global)
    if skipped is not None:  # a skipped average changes nothing but the step
        new_p, mean_e = (
            _collectives.select(skipped, p_in, new_p),
            _collectives.select(skipped, e_in, mean_e),
        )
    if is_global and state.anchor is not None:
        new_anchor = cut.put(state.anchor, new_p)
        if skipped is not None:  # kept as it was, or made common (_anchor_in)
            new_anchor = _collectives.select(skipped, cut.put(state.anchor, a_in), new_anchor)
        state = state.replace(anchor=_collectives.cast_like(new_anchor, state.anchor))
    new_p, mean_e = cut.put(params, new_p), cut.put_aligned(extra, params, mean_e)
    new_p, mean_e = _collectives.cast_like(new_p, params), _collectives.cast_like(mean_e, extra)
    if averager.sync_schedule.tracks_last_sync:  # the schedule's record: all agree
        state = state.replace(last_sync=state.step)
    return new_p, mean_e, state


def _anchor_in(averager: Any, state: ModelAveragerState, cut: Any, branch: tuple, p_in: Any) -> Any:
    """The anchor (cut like the params) this average works from: the state's, or, until
    this fragment's first global average, the group's first replica's
    (``_outer.common_anchor``): the replicas may have been given different params to
    ``init``, and an average from anchors that differ would leave its members apart.

    Needed with ``delta`` (every level) and as the origin of an outer optimizer's step
    without ``outer_skip_first``; an outer optimizer's first global average is otherwise
    a plain mean, which sets a common anchor by itself.
    """
    if state.anchor is None:
        return None
    group, fragment, is_global = branch
    a_in = cut.take(state.anchor)
    if not averager.parts.common_anchor(is_global):
        return a_in
    first_step = averager._first_global_step(fragment.k if fragment is not None else 0)
    first = state.step <= min(first_step, jnp.iinfo(jnp.int32).max)
    return _outer.common_anchor(a_in, p_in, group, first)


def _mean(
    averager: Any, operand: Any, cut: Any, group: Any, state: ModelAveragerState
) -> tuple[Any, jax.Array | None, ModelAveragerState]:
    """The strategy's mean of ``operand = (x, extra)``: ``(mean, skipped, state)`` with
    the strategy's state (cut like the params) and the ``skipped`` record advanced."""
    # A strategy's per-replica state (error feedback) is params-shaped: cut like them.
    residual = state.comm_state
    call_state = None
    if residual is not None:
        call_state = (cut.take(residual), jax.tree.map(jnp.zeros_like, operand[1]))
    # Uncast means: a global mean is invariant, so it can become a replicated anchor.
    mean, skipped, call_state = comm.apply(
        averager.communicator, operand, group, call_state, cast=False, step=state.step
    )
    if residual is not None:
        new_residual = _collectives.cast_like(cut.put(residual, call_state[0]), residual)
        if skipped is not None:
            new_residual = _collectives.select(skipped, residual, new_residual)
        state = state.replace(comm_state=new_residual)
    if state.skipped is not None:
        state = state.replace(skipped=_record(skipped, state.skipped))
    return mean, skipped, state


def _record(skipped: jax.Array | None, like: jax.Array) -> jax.Array:
    """``skipped`` typed like the state's record. A record shared by every replica (a
    state passed unmapped) cannot hold one group's decision: it then says whether any
    group skipped (a one-value all-reduce over the axes the decision varies over)."""
    if skipped is None:
        return jnp.zeros_like(like)
    missing = tuple(a for a in _collectives.vma(skipped) if a not in _collectives.vma(like))
    if missing:
        skipped = _collectives.all_reduce(lax.pmax, skipped.astype(jnp.int32), missing) > 0
    return _collectives.cast_like(skipped, like)


def run(
    averager: Any,
    operand: Any,
    state: ModelAveragerState,
    prepare: Callable[[Any], tuple[Any, Any]],
    finish: Callable[[Any, Any, Any], Any],
    passthrough: Callable[[Any], Any],
) -> tuple[Any, ModelAveragerState]:
    """The one cond/switch: ``finish(average(prepare(operand)))`` or ``passthrough``.

    ``prepare(operand) -> (params, extra)`` and ``finish(operand, params, extra) ->
    result`` run inside the averaging branches only; ``passthrough(operand) -> result``
    is the branch of the steps that do not average. The step is not advanced.
    """

    levels = averager.sync_schedule.num_levels + 1
    if state.pinned_phase is not None and state.pinned_phase == 0:
        # a program of the phase without an average: no group to resolve (a group the
        # mesh lacks fails where it averages, and the build check names that phase)
        with jax.named_scope("model_averaging"):
            return passthrough(operand), state
    specs = averager._branch_groups()

    def make(phase):
        level, lands = phase % levels, phase // levels
        spec = specs[level - 1] if level else None

        def branch(op, st):
            if not level and not lands:
                return passthrough(op), st
            home = st
            if averager.offload_state:  # its buffers onto the device for this average
                st = _offload.buffers(st, jax.memory.Space.Device)
            params, extra = prepare(op)
            if lands:  # the delayed average started `delay` calls ago lands now
                params = _land(params, st)
            if spec is not None and averager.delay and spec[2]:  # a delayed global one
                st2 = _start(averager, params, st, spec)
            elif spec is not None:
                params, extra, st2 = average_level(averager, params, extra, st, spec)
            else:
                st2 = st
            if averager.offload_state:  # and back to host memory
                st2 = _offload.buffers(st2, jax.memory.Space.Host)
            return finish(op, params, extra), _collectives.cast_like(st2, home)

        return branch

    branches = [make(k) for k in range(averager.sync_schedule.num_phases)]
    return dispatch("model_averaging", state, branches, operand, state)


def _start(
    averager: Any, params: Any, state: ModelAveragerState, spec: tuple
) -> ModelAveragerState:
    """A delayed global average starts: the mean (or the outer optimizer's step) of
    ``params`` is taken now and kept in the state (``inflight_mean``), with ``params`` as
    they are now (``inflight_start``); the params do not change until it lands.

    The whole average is in the state the call returns (one truth for work in flight):
    a checkpoint, or any other step path, continues it exactly.
    """
    mean, _, state = average_level(averager, params, None, state, spec)
    return state.replace(
        inflight_start=_collectives.cast_like(params, state.inflight_start),
        inflight_mean=_collectives.cast_like(mean, state.inflight_mean),
    )


def _land(params: Any, state: ModelAveragerState) -> Any:
    """``params + (mean - start)``: the consensus correction on top of the local progress
    made since the average started (floating leaves; integer ones pass)."""
    return jax.tree.map(
        lambda p, m, s: p + (m - s) if _collectives.is_averaged(p) else p,
        params,
        state.inflight_mean,
        state.inflight_start,
    )


def alongside(averager: Any, tree: Any, state: ModelAveragerState, strategy: Any = None) -> Any:
    """The plain group mean of ``tree`` on the branch ``state`` takes (no anchor, outer
    optimizer or fragments; the strategy's state is not advanced), sent with
    ``strategy`` (default: the averager's strategy's ``alongside()``: as the params
    travel, except that a quantized strategy sends them in float32, two-level where it
    is: they get no error feedback, and block scales would round small entries, such
    as running variances, to zero)."""
    strategy = averager.communicator.alongside() if strategy is None else strategy

    def mean(t, group):
        # a strategy that keeps state gets a fresh one: values alongside carry no error
        # feedback between averages (the contract: every mean is given a state)
        fresh = comm.initial_state(strategy, t) if strategy.keeps_state else None
        return comm.apply(strategy, t, group, fresh, step=state.step).value

    per_level = [lambda t: t] + [
        functools.partial(mean, group=group) for group, _, _ in averager._branch_groups()
    ]
    levels = len(per_level)  # with a delay, phase k is level k % levels (landing or not)
    branches = [per_level[k % levels] for k in range(averager.sync_schedule.num_phases)]
    return dispatch("model_state_averaging", state, branches, tree)


def like_params(
    averager: Any, tree: Any, before: ModelAveragerState, after: ModelAveragerState
) -> Any:
    """``tree`` (values that follow the params, such as ``data_parallel_step``'s model
    state) averaged as the params were on the call from ``before`` to ``after``.

    Over the group of the level ``before`` takes; kept where the params' average was
    skipped (``after.skipped``, per group). With a non-finite policy, a replica whose own
    values in ``tree`` are non-finite is left out of their mean and receives it (never a
    skip of their own: they are averaged exactly where the params were); a replica whose
    params were left out (``"exclude"``) still contributes finite values.
    """
    strategy = averager.communicator.alongside()
    if strategy.may_skip:  # values alongside are never skipped on their own account
        strategy = comm.finite_only("exclude")
    mean = alongside(averager, tree, before, strategy)
    if after.skipped is None:
        return mean
    return _collectives.cast_like(_collectives.select(after.skipped, tree, mean), tree)
