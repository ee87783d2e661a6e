"""The averagers: schedules, fragments, anchors, outer steps, delays, non-finite policies."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from spec_model.base import (
    F32,
    Topology,
    Tree,
    bf16_mean,
    exact_mean,
    is_floating,
    short_repr,
    used_members,
)
from spec_model.quantized import QuantConfig, quantized_group_mean

# --- the averagers ------------------------------------------------------------------------


@short_repr
@dataclasses.dataclass(frozen=True)
class OuterConfig:
    """An outer ``optax.sgd(lr, momentum, nesterov)``; with ``cooldown=(total,
    fraction)`` ``averaging.diloco_outer(total, lr, momentum, cooldown=fraction)``."""

    lr: float
    momentum: float | None = None
    nesterov: bool = False
    cooldown: tuple[int, float] | None = None

    def at(self, updates: int, skip_first: bool = True) -> tuple[np.float32, np.float32 | None]:
        """Rule (diloco_outer): "of the ``U = total - 1`` updates with
        ``outer_skip_first`` (the first average, at the switch, is not an outer update;
        ``U = total`` without), the last ``C = ceil(fraction * U)`` (at least 1) are
        cooled: update ``k`` runs at ``r = max(0, k - (U - C) + 1) / C``, learning rate
        ``lr + (1 - lr) r`` and momentum ``m (1 - r)``, so the last one is the plain
        average (1, 0)"; ``k`` counts the outer optimizer's own updates; ``skip_first``
        is the averager's, which diloco_outer must be given (the averager checks)."""
        if self.cooldown is None:
            return F32(self.lr), None if self.momentum is None else F32(self.momentum)
        total, fraction = self.cooldown
        u = total - 1 if skip_first else total
        c = max(1, math.ceil(round(fraction * u, 6))) if u else 0
        ramp = F32(min(max((updates - (u - c) + 1) / c, 0.0), 1.0) if c else 1.0)
        lr, m = F32(self.lr), F32(self.momentum)
        return lr * (F32(1.0) - ramp) + ramp, m * (F32(1.0) - ramp)


@short_repr
@dataclasses.dataclass(frozen=True)
class AveragerConfig:
    """A PeriodicModelAverager (``levels`` empty) or HierarchicalModelAverager.

    period: the Periodic period: an int, or the name of a schedule in ``SCHEDULES``.
    levels: the Hierarchical ``((period, group axes or None), ...)``.
    delay: ``delay=tau`` (0: none). quant: ``communication=comm.quantized(...)`` (None:
    from ``nonfinite`` / ``bf16``).
    """

    kind: str  # "periodic" | "hierarchical"
    period: int | str = 2
    levels: tuple[tuple[int, tuple[str, ...] | None], ...] = ()
    warmup: int = 0
    process_group: tuple[str, ...] | None = None
    fragments: int = 1
    nonfinite: str = "propagate"
    outer: OuterConfig | None = None
    outer_skip_first: bool = True
    bf16: bool = False
    delta: bool = False
    delay: int = 0
    quant: QuantConfig | None = None

    @property
    def keeps_anchor(self) -> bool:
        """Rule: "anchor (kept when delta or outer_optimizer)"."""
        return self.delta or self.outer is not None

    @property
    def num_levels(self) -> int:
        return self.fragments if self.kind == "periodic" else len(self.levels)

    def group(self, level: int) -> tuple[str, ...] | None:
        """The axes that average at ``level`` (1-based): Periodic: "Group = process_group
        (default global)"; Hierarchical: the level's group, "last group = global"."""
        if self.kind == "periodic":
            return self.process_group
        return self.levels[level - 1][1]

    def is_global(self, level: int) -> bool:
        """The global level: every level of a Periodic averager (every fragment), the
        last level of a Hierarchical one."""
        return self.kind == "periodic" or level == len(self.levels)


SCHEDULES: dict[str, Callable[[int], int]] = {
    "3_then_2": lambda s: 3 if s < 6 else 2,
    "always_4": lambda s: 4,
}
"""Callable periods by name (the tests pass the same rules as jit-able functions)."""


def periodic_level(step: int, period: int, warmup: int, fragments: int) -> int:
    """Rule: "averages when s >= w and (s - w) % (period/K) == 0; level = ((s - w) //
    (period/K)) % K + 1 (K=1: level 1)"."""
    stride = period // fragments
    if step < warmup or (step - warmup) % stride:
        return 0
    return ((step - warmup) // stride) % fragments + 1


def scheduled_level(step: int, period: Callable[[int], int], warmup: int, last: int) -> int:
    """Rule: "Callable period (Periodic only): averages at s when s >= w and (s == w or
    s - last_average_step >= period(s))"."""
    if step < warmup:
        return 0
    return int(step == warmup or step - last >= period(step))


def hierarchical_level(step: int, periods: list[int], warmup: int) -> int:
    """Rule: "when s >= w, the LARGEST period p with s % p == 0 (s, not s - w) averages
    over its group; level = its 1-based index"."""
    if step < warmup:
        return 0
    return max((k for k, p in enumerate(periods, 1) if step % p == 0), default=0)


def fragment_masks(template: Tree, fragments: int, level: int) -> Tree:
    """The positions that an average at ``level`` touches, per leaf.

    Rule: "the floating leaves of the params, in jax.tree.leaves order, flattened and
    concatenated (total T values), are cut into K consecutive chunks of ceil(T/K) (the
    last may be shorter); level k averages chunk k-1 only." Without fragments: every
    position of every floating leaf. ``template``: one replica's leaves (dict keys in
    sorted order, which is jax.tree.leaves order for a dict).
    """
    names = sorted(template)
    floating = [k for k in names if is_floating(template[k])]
    total = sum(template[k].size for k in floating)
    chunk = -(-total // fragments)
    lo, hi = (level - 1) * chunk, min(level * chunk, total)
    masks, offset = {}, 0
    for k in names:
        x = template[k]
        mask = np.zeros(x.size, bool)
        if k in floating:
            idx = np.arange(offset, offset + x.size)
            mask = (idx >= lo) & (idx < hi) if fragments > 1 else np.ones(x.size, bool)
            offset += x.size
        masks[k] = mask.reshape(x.shape)
    return masks


@dataclasses.dataclass
class AveragerState:
    """The averager's state, per replica where it can differ.

    step: int, "starts 0, +1 on every call, also on calls that do not average".
    anchor: params at the previous global average (initially the params given to init).
    outer_trace: the outer sgd's momentum, per replica (None without momentum).
    outer_count: per replica, "+= 1 on every non-skipped global average".
    last_sync: the step of the last average (a callable period).
    residual: quantized with error feedback: "what rounding dropped is kept per replica
    and sent with the next mean", params-shaped (floating leaves float32/complex64).
    inflight_start / inflight_mean: with a delay, the params when the global average in
    flight started and that average's result (initially both the params given to init).
    """

    step: int
    anchor: Tree | None
    outer_trace: Tree | None
    outer_count: np.ndarray
    last_sync: int = 0
    residual: Tree | None = None
    inflight_start: Tree | None = None
    inflight_mean: Tree | None = None

    def copy(self) -> AveragerState:
        def dup(t):
            return None if t is None else {k: v.copy() for k, v in t.items()}

        return AveragerState(
            self.step,
            dup(self.anchor),
            dup(self.outer_trace),
            self.outer_count.copy(),
            self.last_sync,
            dup(self.residual),
            dup(self.inflight_start),
            dup(self.inflight_mean),
        )


def averager_init(cfg: AveragerConfig, params: Tree) -> AveragerState:
    """step 0; the anchor is the params given to init; outer momentum zero; a zero
    residual (quantized, error feedback); with a delay, nothing in flight: start = mean
    = the params given to init."""
    n = len(next(iter(params.values())))
    anchor = {k: v.copy() for k, v in params.items()} if cfg.keeps_anchor else None
    trace = None
    if cfg.outer is not None and cfg.outer.momentum is not None:
        trace = {k: np.zeros_like(v) for k, v in params.items() if is_floating(v)}
    state = AveragerState(0, anchor, trace, np.zeros(n, np.int32))
    if cfg.quant is not None and cfg.quant.error_feedback:
        state.residual = {
            k: np.zeros(v.shape, np.complex64 if np.iscomplexobj(v) else F32)
            for k, v in params.items()
            if is_floating(v)
        }
    if cfg.delay:
        state.inflight_start = {k: v.copy() for k, v in params.items()}
        state.inflight_mean = {k: v.copy() for k, v in params.items()}
    return state


def averager_level(cfg: AveragerConfig, state: AveragerState) -> int:
    """The level of the current call (0: no average), from the counters only."""
    if cfg.kind == "hierarchical":
        return hierarchical_level(state.step, [p for p, _ in cfg.levels], cfg.warmup)
    if isinstance(cfg.period, str):
        return scheduled_level(state.step, SCHEDULES[cfg.period], cfg.warmup, state.last_sync)
    return periodic_level(state.step, cfg.period, cfg.warmup, cfg.fragments)


def outer_step(
    cfg: OuterConfig,
    anchor: np.ndarray,
    mean: np.ndarray,
    trace: np.ndarray | None,
    updates: int = 0,
    skip_first: bool = True,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Rule: "pseudo_grad = anchor - m; (upd, outer_state) = outer.update(pseudo_grad,
    outer_state, anchor); new = anchor + upd (computed as m + (pseudo_grad + upd), so
    optax.sgd(1.0) gives m exactly)"; ``updates``: the outer optimizer's updates before
    this one and ``skip_first`` the averager's (``OuterConfig.at``). Returns ``(new,
    new_trace)``."""
    pseudo = anchor - mean
    lr, m = cfg.at(updates, skip_first)
    if m is None:
        upd = -lr * pseudo
    else:
        trace = pseudo + m * trace
        upd = -lr * ((pseudo + m * trace) if cfg.nesterov else trace)
    return mean + (pseudo + upd), trace


@dataclasses.dataclass
class Averaged:
    """What one averager call did: the new values and which positions were assigned.

    params: every replica's params after the call (the group value where assigned, the
    incoming value elsewhere). assigned: per leaf, the positions that received a group
    value (a skipped group's members: none). extra: the averaged opt-state components.
    level: the level of the call (0: none). groups: the (members, leaf masks) that were
    averaged (the groups model state follows). started: a delayed global average
    started on this call (its groups' params are not assigned now; no bitwise check).
    """

    params: Tree
    assigned: Tree
    extra: dict[str, Any]
    level: int
    groups: list[tuple[list[int], Tree]]
    started: bool = False

    @property
    def bitwise_groups(self) -> list[tuple[list[int], Tree]]:
        """The groups whose members ``average_parameters`` left bitwise identical."""
        return [] if self.started else self.groups


def first_global_step(cfg: AveragerConfig, level: int) -> int:
    """The step of the first global average of ``level``'s fragment: Periodic "s = w +
    (k - 1) * period / K" (a callable period: w); Hierarchical "the first multiple of the
    last period from w on" (every level alike)."""
    if cfg.kind == "hierarchical":
        last = cfg.levels[-1][0]
        return -(-cfg.warmup // last) * last
    if isinstance(cfg.period, str):
        return cfg.warmup
    return cfg.warmup + (level - 1) * (cfg.period // cfg.fragments)


def working_anchor(
    cfg: AveragerConfig, state: AveragerState, level: int, masks: Tree, topo: Topology
) -> Tree | None:
    """The anchor an average works from, per replica.

    Rule: "until its fragment's first global average (step <= that average's step), an
    average with delta (any level), or the outer optimizer's step without
    outer_skip_first, works from the group's first member's anchor at the fragment's
    positions: the replicas may have been given different params to init"; the state's
    anchor otherwise.
    """
    if not cfg.keeps_anchor:
        return None
    outer_origin = cfg.is_global(level) and cfg.outer is not None and not cfg.outer_skip_first
    if not (cfg.delta or outer_origin) or state.step > first_global_step(cfg, level):
        return state.anchor
    anchor = {k: v.copy() for k, v in state.anchor.items()}
    for members in topo.groups(cfg.group(level)):
        for k, v in anchor.items():
            if is_floating(v):
                v[members] = np.where(masks[k], v[members[0]], v[members])
    return anchor


def _set_anchor(state: AveragerState, values: Tree, members: list[int], masks: Tree) -> None:
    """The members' anchor at the fragment's positions <- ``values`` (floating leaves)."""
    for k, v in values.items():
        if is_floating(v):
            for r in members:
                state.anchor[k][r][masks[k]] = v[r][masks[k]]


def _contribution(values: Tree, masks: Tree, r: int) -> list[np.ndarray]:
    return [values[k][r][masks[k]] for k in sorted(values) if masks[k].any()]


def _finite(x: Tree, extra: dict[str, Any], masks: Tree, r: int) -> bool:
    """Whether every value member r contributes to this average (its params part, and the
    opt-state leaves averaged with it) is finite."""
    parts = _contribution(x, masks, r)
    for c in extra.values():
        if isinstance(c, dict):
            parts += _contribution(c, masks, r)
        elif is_floating(c):
            parts.append(np.ravel(c[r]))
    return all(np.isfinite(p).all() for p in parts)


def _outer_steps(
    cfg: OuterConfig, skip_first: bool, states: tuple, anchor: Tree, out: Tree, members: list[int]
) -> None:
    """The outer optimizer's step of each member from ``anchor`` to ``out`` (in place)."""
    state, new_state = states
    for r in members:
        first = skip_first and state.outer_count[r] == 0
        for k, v in out.items():
            if first or not is_floating(v):
                continue
            trace = None if state.outer_trace is None else state.outer_trace[k][r]
            updates = int(state.outer_count[r]) - int(skip_first)  # the first was plain
            new, trace = outer_step(cfg, anchor[k][r], v[r], trace, updates, skip_first)
            out[k][r] = new
            if trace is not None:
                new_state.outer_trace[k][r] = trace
        new_state.outer_count[r] = state.outer_count[r] + 1


def _average_extra(
    extra: dict[str, Any], new_extra: dict[str, Any], masks: Tree, who: tuple, mean_fn: Callable
) -> None:
    """The chosen opt-state components' means over ``src``, given to ``members``."""
    members, src = who
    for name, c in extra.items():
        if isinstance(c, dict):
            for k, v in c.items():
                if masks[k].any():
                    m = mean_fn(v[src][:, masks[k]])
                    for r in members:
                        new_extra[name][k][r][masks[k]] = m
        elif is_floating(c):
            new_extra[name][members] = mean_fn(c[src])


def lands(cfg: AveragerConfig, step: int) -> bool:
    """Rule (delay): "A global average ... lands tau calls after it starts": at call t
    when the call t - tau started a global average."""
    if not cfg.delay:
        return False
    started = averager_level(cfg, AveragerState(step - cfg.delay, None, None, np.zeros(0)))
    return bool(started) and cfg.is_global(started)


def land(params: Tree, state: AveragerState) -> Tree:
    """Rule (delay): "at call t + tau, after that call's update, params become params +
    (mean - s): the consensus correction on top of the local progress made meanwhile"
    (floating leaves; integer leaves pass)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return {
            k: (v + (state.inflight_mean[k] - state.inflight_start[k])).astype(v.dtype)
            if is_floating(v)
            else v
            for k, v in params.items()
        }


def average_call(
    cfg: AveragerConfig,
    state: AveragerState,
    params: Tree,
    topo: Topology,
    extra: dict[str, Any] | None = None,
) -> tuple[Averaged, AveragerState]:
    """One averager call on the params after the inner update (and chosen opt-state).

    Rules (delay): "+1 on every call"; a landing (``lands``) comes first, on the params
    after this call's update; then, "at a call t that averages" a global average, "each
    replica keeps its params s as they are and starts the mean (or the outer optimizer's
    step) of s": the whole average (anchor, outer state, residual included) happens now,
    its result is kept in flight and the params do not change; any other average (a
    hierarchy's lower levels) happens at once, on the landed params. On a call that
    lands or starts, every floating position goes through the averaging branch (for
    the updates paths: ``u' = new - p``). The docstring says the correction lands
    "after that call's update" but not what happens when the call that lands also
    averages a lower level; the code (``_average_call.run``) lands first, then averages.
    """
    extra = dict(extra or {})
    level = averager_level(cfg, state)
    new_state = state.copy()
    new_state.step = state.step + 1
    landing = lands(cfg, state.step)
    x = land(params, state) if landing else params
    starts = bool(level) and bool(cfg.delay) and cfg.is_global(level)
    avg = _average(cfg, (state, new_state), level, x, topo, extra)
    if starts:
        new_state.inflight_start = {k: v.copy() for k, v in x.items()}
        new_state.inflight_mean = {k: v.copy() for k, v in avg.params.items()}
        avg = Averaged(x, avg.assigned, avg.extra, level, avg.groups, started=True)
    if landing or starts:
        avg.assigned = {k: np.full(v.shape, is_floating(v)) for k, v in x.items()}
    return avg, new_state


def _average(
    cfg: AveragerConfig,
    states: tuple[AveragerState, AveragerState],
    level: int,
    params: Tree,
    topo: Topology,
    extra: dict[str, Any],
) -> Averaged:
    """One level's average of ``params`` (and chosen opt-state); updates ``states[1]``.

    Rules: at a level with group G (per group of that level):
      * "delta=True: x_r <- x_r - anchor, and the result is anchor + mean", the anchor
        being common until the fragment's first global average (``working_anchor``).
      * the non-finite policy, "a member is non-finite if any value it contributes to
        THIS average (its params part, plus the opt-state leaves averaged with it) is
        NaN/Inf" (see ``used_members``).
      * "A skipped average ... changes NOTHING but the step counter" (and, at a global
        level, the anchor becomes the common one ``working_anchor`` worked from).
      * outer optimizer at the global level: "If outer_skip_first (default True) and
        outer_count == 0: new = m, outer state unchanged. Else ..." (``outer_step``);
        "outer_count += 1 on every non-skipped global average. Only floating leaves:
        integer leaves keep their own value."
      * "after every non-skipped global average, anchor <- the new global value (with
        fragments: only that fragment's positions change)".
      * chosen opt-state leaves: "averaged on the same steps, over the same group, with
        the same finiteness decision as the params, and assigned the mean ... With
        fragments: chosen leaves that belong to a params-shaped part of the state ... are
        cut exactly like the params ...; any other chosen leaf is averaged whole at every
        fragment average. They take no part in delta/anchor/outer optimizer."
      * quantized: the fragment's floating values (and this replica's residual) travel
        as one flat buffer (``quantized_buffers``).
    ``extra``: chosen opt-state components, a params-shaped dict or a per-replica array.
    """
    state, new_state = states
    out = {k: v.copy() for k, v in params.items()}
    assigned = {k: np.zeros(v.shape, bool) for k, v in params.items()}
    new_extra = {
        name: ({k: v.copy() for k, v in c.items()} if isinstance(c, dict) else c.copy())
        for name, c in extra.items()
    }
    done: list[tuple[list[int], Tree]] = []
    if level == 0:
        return Averaged(out, assigned, new_extra, 0, done)
    if isinstance(cfg.period, str):
        new_state.last_sync = state.step
    template = {k: v[0] for k, v in params.items()}
    masks = fragment_masks(template, cfg.fragments, level)
    is_global = cfg.is_global(level)
    mean_fn = bf16_mean if cfg.bf16 else exact_mean
    anchor = working_anchor(cfg, state, level, masks, topo)
    with np.errstate(invalid="ignore", over="ignore"):
        x = params
        if cfg.delta:
            x = {k: v - anchor[k] if is_floating(v) else v for k, v in params.items()}
        for members in topo.groups(cfg.group(level)):
            finite = [_finite(x, extra, masks, r) for r in members]
            used = used_members(finite, cfg.nonfinite)
            if used is None:  # skipped: nothing changes for this group but the anchor
                if is_global and cfg.keeps_anchor:
                    _set_anchor(new_state, anchor, members, masks)
                continue
            src = [members[i] for i in used]
            if cfg.quant is not None:
                group = (cfg.group(level) or topo.names, members)
                means = quantized_buffers(cfg, (state, new_state), x, masks, group, topo)
            else:
                means = {k: mean_fn(v[src][:, masks[k]]) for k, v in x.items() if masks[k].any()}
            for k, m in means.items():
                for r in members:
                    value = anchor[k][r][masks[k]] + m if cfg.delta else m
                    out[k][r][masks[k]] = value
                    assigned[k][r][masks[k]] = True
            if is_global and cfg.outer is not None:
                _outer_steps(
                    cfg.outer, cfg.outer_skip_first, (state, new_state), anchor, out, members
                )
            if is_global and cfg.keeps_anchor:
                _set_anchor(new_state, out, members, masks)
            _average_extra(extra, new_extra, masks, (members, src), mean_fn)
            done.append((members, masks))
    return Averaged(out, assigned, new_extra, level, done)


def quantized_buffers(
    cfg: AveragerConfig,
    states: tuple[AveragerState, AveragerState],
    x: Tree,
    masks: Tree,
    group: tuple[tuple[str, ...], list[int]],
    topo: Topology,
) -> Tree:
    """The quantized mean of ``x`` at ``masks`` over a group (its axes, as the averager
    names them, and its members), per leaf; the members' residuals (``states[1]``) at
    ``masks`` advanced.

    Rule: "The floating leaves are flattened into one float32 buffer (with error
    feedback, plus this replica's residual)" (leaves in tree order, a complex leaf as
    its real then its imaginary part; with fragments only the fragment's values, the
    residual "cut like the params for fragments"). two_level: "over a group that holds
    inner_axis and more axes" two levels; "a mean over the node's axis alone ... is then
    a plain float32 all-reduce, and leaves the residual alone" (and, read from the code:
    of the values without the residual). Otherwise one level over the group.
    """
    state, new_state = states
    q = cfg.quant
    names = [k for k in sorted(x) if is_floating(x[k]) and masks[k].any()]

    def flat(tree: Tree, r: int) -> np.ndarray:
        parts = []
        for k in names:
            v = tree[k][r][masks[k]]
            parts += [v.real, v.imag] if np.iscomplexobj(v) else [v]
        return np.concatenate([p.astype(F32) for p in parts])

    def unflat(buf: np.ndarray) -> Tree:
        out, offset = {}, 0
        for k in names:
            n = int(masks[k].sum())
            v = buf[offset : offset + n]
            offset += n
            if np.iscomplexobj(x[k]):
                v = (v + 1j * buf[offset : offset + n]).astype(x[k].dtype)
                offset += n
            out[k] = v.astype(x[k].dtype)
        return out

    group_axes, members = group
    values = np.stack([flat(x, r) for r in members])
    if q.two_level and tuple(group_axes) == ("local",):
        return unflat(exact_mean(values))
    inner = 1
    if q.two_level and "local" in group_axes and len(group_axes) > 1:
        inner = topo.shape[topo.names.index("local")]
    with np.errstate(invalid="ignore", over="ignore"):
        if state.residual is not None:
            values = values + np.stack([flat(state.residual, r) for r in members])
        mean, residual = quantized_group_mean(values, q, inner)
    if new_state.residual is not None:
        for i, r in enumerate(members):
            for k, v in unflat(residual[i]).items():
                new_state.residual[k][r][masks[k]] = v
    return unflat(mean)


def average_model_state(cfg: AveragerConfig, averaged: Averaged | None, model_state: Tree) -> Tree:
    """Rule: model state is "per replica, averaged (plain group mean, with the averager's
    communication_dtype; no delta/anchor/outer) on exactly the calls, and over exactly
    the groups, where the params were averaged: a group whose params' average was
    skipped keeps its model state; with fragments, whole at every fragment average. With
    a non-finite policy, a member whose own model state is non-finite is left out of the
    mean and receives it (never a skip of its own); a member whose params were left out
    ("exclude") still contributes a finite model state". Integer leaves stay. Delay:
    "Model state ... is averaged when the average starts" (a landing moves none).
    Quantized: model state travels "in float32 (two-level where it is)": an exact mean."""
    if averaged is None or averaged.level == 0:
        return model_state
    out = {k: v.copy() for k, v in model_state.items()}
    mean_fn = bf16_mean if cfg.bf16 else exact_mean
    floating = [k for k in sorted(model_state) if is_floating(model_state[k])]
    policy = "exclude" if cfg.nonfinite != "propagate" else "propagate"
    for members, _ in averaged.groups:
        finite = [all(np.isfinite(model_state[k][r]).all() for k in floating) for r in members]
        used = used_members(finite, policy)
        if used is None:
            continue
        src = [members[i] for i in used]
        for k in floating:
            out[k][members] = mean_fn(model_state[k][src])
    return out
