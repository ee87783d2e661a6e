"""An executable specification of lsgd_jax: the documented rules, in plain NumPy.

Nothing here imports lsgd_jax, jax or optax. The model replays R replicas step by step,
each rule in its own small function whose docstring quotes the rule it implements. Values
are stacked per replica: every array has a leading replica axis of size R, and replica r
is the device at row-major position r of the mesh. Arithmetic is float32 where the library
is float32 (group means are taken in float64 and rounded once, so they agree with any
summation order to a float32 ulp or so); ``ml_dtypes.bfloat16`` models the rounding of
``communication_dtype=jnp.bfloat16``, and ``quantize_blocks`` replays the rounding of
``comm.quantized`` exactly (it is deterministic), stage by stage, with its residual.

A run is described by plain, hashable configs (``Topology``, ``HookConfig``,
``InnerConfig``, ``AveragerConfig``, ``RunConfig``) and a list of per-step ``Batch``es;
``simulate`` returns one ``Snapshot`` (a dict of named per-replica arrays) per step, the
names being what the tests read back from the library's state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

F32 = np.float32
BF16 = ml_dtypes.bfloat16

Tree = dict[str, np.ndarray]  # leaf name -> per-replica array (R, *shape)
Snapshot = dict[str, np.ndarray]
TRAINABLE = ("a", "b")  # the float32 params leaves the loss (and the optimizer) sees


def short_repr(cls):
    """A dataclass repr that shows only the fields that differ from their defaults, so
    that hypothesis's falsifying examples read as the options that matter."""

    def __repr__(self):
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.default is dataclasses.MISSING or value != f.default:
                parts.append(f"{f.name}={value!r}")
        return f"{type(self).__name__}({', '.join(parts)})"

    def _repr_pretty_(self, printer, cycle):  # what hypothesis prints examples with
        printer.text(repr(self))

    cls.__repr__ = __repr__
    cls._repr_pretty_ = _repr_pretty_
    return cls


# --- mesh and groups ----------------------------------------------------------------------


@short_repr
@dataclasses.dataclass(frozen=True)
class Topology:
    """The data axes of the mesh, e.g. ``("node", "local")`` with shape ``(2, 4)``."""

    names: tuple[str, ...]
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def coords(self, r: int) -> tuple[int, ...]:
        """Rule: "Replica r is the device at row-major position r"."""
        return tuple(int(c) for c in np.unravel_index(r, self.shape))

    def groups(self, axes: tuple[str, ...] | None) -> list[list[int]]:
        """Rule: "A group named by axes A = the replicas that share their coordinates on
        every data axis NOT in A; the global group = all data axes" (``None``: global)."""
        axes = self.names if axes is None else tuple(axes)
        unknown = set(axes) - set(self.names)
        assert not unknown, f"axes {unknown} are not data axes of {self.names}"
        keep = [i for i, name in enumerate(self.names) if name not in axes]
        out: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.size):
            c = self.coords(r)
            out.setdefault(tuple(c[i] for i in keep), []).append(r)
        return list(out.values())


# --- means --------------------------------------------------------------------------------


def is_floating(x: np.ndarray) -> bool:
    """Rule: "Only floating leaves are averaged" (complex leaves count as floating)."""
    return np.issubdtype(x.dtype, np.inexact)


def exact_mean(xs: np.ndarray) -> np.ndarray:
    """The arithmetic mean over the leading (member) axis, rounded once to the dtype."""
    wide = np.complex128 if np.iscomplexobj(xs) else np.float64
    with np.errstate(invalid="ignore", over="ignore"):
        return xs.astype(wide).mean(axis=0).astype(xs.dtype)


def bf16_mean(xs: np.ndarray) -> np.ndarray:
    """Rule (communication_dtype=jnp.bfloat16): "each member's x (float32) is rounded to
    bf16, summed in float32, divided by |G|, and the mean rounded to bf16 again, then cast
    to the leaf's dtype; complex leaves are averaged as their real and imaginary parts"."""
    if np.iscomplexobj(xs):
        real = bf16_mean(xs.real.astype(F32))
        imag = bf16_mean(xs.imag.astype(F32))
        return (real + 1j * imag).astype(xs.dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        sent = xs.astype(F32).astype(BF16).astype(F32)
        total = sent.sum(axis=0, dtype=F32)
        return (total / F32(len(xs))).astype(BF16).astype(xs.dtype)


def group_mean(x: np.ndarray, groups: list[list[int]]) -> np.ndarray:
    """Every member of each group receives the plain mean of the group (NaN spreads)."""
    out = x.copy()
    for g in groups:
        out[g] = exact_mean(x[g])
    return out


def used_members(finite: list[bool], policy: str) -> list[int] | None:
    """Which members a mean is taken over, or None for a skipped average.

    Rule: "propagate (default): plain mean, NaN spreads. exclude: mean of the finite
    members only, which every member (the non-finite ones too) receives; if no member is
    finite, nothing changes (as skip). skip: if any member of G is non-finite, the whole
    group keeps its own values this time."
    """
    everyone = list(range(len(finite)))
    if policy == "propagate":
        return everyone
    if policy == "exclude":
        chosen = [i for i in everyone if finite[i]]
        return chosen or None
    if policy == "skip":
        return everyone if all(finite) else None
    raise ValueError(policy)


# --- quantized means (comm.quantized) -----------------------------------------------------

QMAX = {8: 127, 4: 7}


def quantize_blocks(x: np.ndarray, bits: int, block: int) -> np.ndarray:
    """What the receivers decode from ``x`` (last axis whole blocks), in float32.

    Rule: "a block x travels as q = round(x / s), s = max|x| / qmax (qmax 127 for 8 bits,
    7 for 4 bits)"; "a zero block gets scale 1; a block with a NaN or Inf anywhere gets
    scale NaN" (so "that whole block of the mean is NaN", "wherever in the block it
    sits"). ``round`` is half to even (jnp.round).
    """
    qmax = F32(QMAX[bits])
    blocks = x.astype(F32).reshape(*x.shape[:-1], -1, block)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        scale = np.abs(blocks).max(axis=-1) / qmax
        scale = np.where(scale == 0, F32(1), scale)
        scale = np.where(np.isfinite(blocks).all(axis=-1), scale, F32(np.nan)).astype(F32)
        q = np.clip(np.round(blocks / scale[..., None]), -qmax, qmax)
        q = np.where(np.isnan(q), F32(0), q).astype(F32)
        return (q * scale[..., None]).reshape(x.shape)


def quant_layout(length: int, inner: int, outer: int, bits: int, block_size: int):
    """``(block, chunk, padded)``, or None where the mean is sent in float32.

    Rule (``_quantize.plan``): "Each replica's chunk is its share of the values (of the
    shard), padded to whole blocks, and a block is never longer than the chunk"; "the
    bytes over the outer group are compared ...: all-to-all + all-gather, 2 (outer - 1)
    x chunk bytes, against a ring all-reduce, 2 (outer - 1) / outer x 4 x ceil(length /
    inner)" (None when the integers send no fewer); "a group of one" sends no integers.
    The docstring does not spell out "bits=4: a block of an even length"; it is read
    from the code.
    """
    if length == 0 or outer == 1:
        return None
    values = -(-length // inner)
    share = -(-values // outer)
    block = min(block_size, share + share % 2 if bits == 4 else share)
    chunk = -(-share // block) * block
    chunk_bytes = chunk * bits // 8 + 4 * (chunk // block)
    if outer * chunk_bytes >= 4 * values:  # both sides times outer / (2 (outer - 1))
        return None
    return block, chunk, inner * outer * chunk


def wire(kind: str, operand_bytes: int, group: int) -> int:
    """Rule (``Collective.wire_bytes``): "Ring all-reduce 2 (g - 1) / g x bytes;
    all-gather (g - 1) x bytes; reduce-scatter and all-to-all (g - 1) / g x bytes", for a
    group of g, rounded to whole bytes."""
    factor = {"all-reduce": 2 * (group - 1) / group, "all-gather": group - 1}
    return round(operand_bytes * factor.get(kind, (group - 1) / group))


def bytes_across(strategy: str | QuantConfig, length: int, nodes: int, local: int) -> int:
    """Wire bytes one device sends in collectives whose groups span nodes, for a global
    mean of ``length`` float32 values on a ``nodes x local`` mesh. ``strategy``: "flat",
    "two_level", or a ``QuantConfig``.

    Rules: flat: "one all-reduce of every floating leaf". two_level: "reduce-scatter
    inside each node, all-reduce of the shards across nodes (the only step that crosses
    nodes, carrying 1 / (devices per node) of the values per device), all-gather inside
    the node". quantized: "an all_to_all (each replica receives its chunk from every
    peer) and an all_gather of the chunk means", of the chunk's integers and scales
    (``chunk x bits / 8`` bytes, plus 4 a block), over all replicas (one level) or, with
    two_level, across nodes on the node's shard; where quantizing would send no fewer
    bytes on the link, the float32 mean: one all-reduce (one level), the two-level mean
    (two_level).
    """
    if nodes == 1:
        return 0
    n = nodes * local
    flat = wire("all-reduce", 4 * length, n)
    two_level = wire("all-reduce", 4 * -(-length // local), nodes)
    if strategy == "flat":
        return flat
    if strategy == "two_level":
        return two_level
    q = strategy
    inner = local if q.two_level and local > 1 else 1  # a node of one: one level
    layout = quant_layout(length, inner, n // inner, q.bits, q.block_size)
    if layout is None:
        return two_level if inner > 1 else flat
    block, chunk, _ = layout
    outer = n // inner
    chunk_bytes = chunk * q.bits // 8 + 4 * (chunk // block)
    return wire("all-to-all", outer * chunk_bytes, outer) + wire("all-gather", chunk_bytes, outer)


def quantized_one_level(rows: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The one-level quantized mean of ``rows`` (g members in position order, each g
    chunks): ``(mean, residuals)``.

    Rule: "an all_to_all hands each replica its chunk from every peer, its own included,
    quantized alike; it dequantizes, sums in float32 and divides: its chunk of the mean;
    it quantizes that chunk mean again and an all_gather ... returns the whole mean";
    "a replica's residual holds its stage-1 rounding error on every chunk, and, on the
    chunk it summed, n times the stage-2 rounding error of that chunk mean"; "the
    residual stays finite (0 where the values were not)". Replica at position j sums
    chunk j.
    """
    g = len(rows)
    x = rows.reshape(g, g, -1)  # member, chunk
    sent = quantize_blocks(x, bits, block)
    with np.errstate(invalid="ignore", over="ignore"):
        total = sent[0].copy()
        for m in range(1, g):
            total = total + sent[m]
        chunk_mean = total / F32(g)
        sent2 = quantize_blocks(chunk_mean, bits, block)
        residual = x - sent
        for j in range(g):
            residual[j, j] = residual[j, j] + F32(g) * (chunk_mean[j] - sent2[j])
    residual = np.where(np.isfinite(residual), residual, F32(0))
    return sent2.reshape(-1), residual.reshape(g, -1)


def quantized_group_mean(
    xs: np.ndarray, q: QuantConfig, inner: int
) -> tuple[np.ndarray, np.ndarray]:
    """The quantized mean of the flat buffers ``xs`` (values plus residuals, one row per
    member in row-major order) and the members' new residuals.

    Rule: one level (``inner == 1``) or, with two_level, "a float32 reduce-scatter inside
    the node ..., the quantized mean across nodes of this device's shard of the node's
    sum, a float32 all-gather inside the node. The residual is then this device's
    shard's: zero elsewhere"; where the integers would put no fewer bytes on the link
    they cross (``quant_layout``), "the mean is sent in float32 instead: one all-reduce,
    or with two levels the float32 two-level mean ... It is exact, and the residual
    becomes zero"; padding follows the data (zeros, cut off again).
    """
    g, length = xs.shape
    outer = g // inner
    layout = quant_layout(length, inner, outer, q.bits, q.block_size)
    if layout is None:
        return exact_mean(xs), np.zeros_like(xs)
    block, _, padded = layout
    x = np.zeros((g, padded), F32)
    x[:, :length] = xs
    if inner == 1:
        mean, residual = quantized_one_level(x, q.bits, block)
        return mean[:length], residual[:, :length]
    nodes = x.reshape(outer, inner, padded)  # a member is (node position, local index)
    with np.errstate(invalid="ignore", over="ignore"):
        sums = nodes[:, 0].copy()
        for i in range(1, inner):
            sums = sums + nodes[:, i]
    width = padded // inner
    mean = np.zeros(padded, F32)
    residual = np.zeros((outer, inner, padded), F32)
    for i in range(inner):  # local device i sums shard i of its node
        part = slice(i * width, (i + 1) * width)
        mean[part], residual[:, i, part] = quantized_one_level(sums[:, part], q.bits, block)
    with np.errstate(invalid="ignore"):
        mean = mean / F32(inner)
    return mean[:length], residual.reshape(g, padded)[:, :length]


# --- the hook -----------------------------------------------------------------------------


@short_repr
@dataclasses.dataclass(frozen=True)
class HookConfig:
    """``PostLocalSGDState(process_group, subgroup, start, post_local_gradient_allreduce)``."""

    start: int
    post_local_gradient_allreduce: bool = True
    subgroup: tuple[str, ...] | None = None  # None: ("local",)
    process_group: tuple[str, ...] | None = None  # None: every data axis


def hook_step(cfg: HookConfig, it: int, grads: Tree, topo: Topology) -> tuple[Tree, int]:
    """Rule: "If start == 0: local phase from the start. If iter < start: g <- mean of g
    over the global group, iter += 1. Else: g <- mean over the subgroup if
    post_local_gradient_allreduce else g unchanged; iter stays. Only floating leaves are
    averaged. A NaN in a mean spreads to the whole group." The hook's iter stops at start.
    """
    if cfg.start > 0 and it < cfg.start:
        groups = topo.groups(cfg.process_group)
        return {k: group_mean(g, groups) for k, g in grads.items()}, it + 1
    if not cfg.post_local_gradient_allreduce:
        return grads, it
    groups = topo.groups(cfg.subgroup if cfg.subgroup is not None else ("local",))
    return {k: group_mean(g, groups) for k, g in grads.items()}, it


def ddp_mean(grads: Tree, topo: Topology) -> Tree:
    """Rule: "Without a hook, data_parallel_step averages gradients over all data axes
    every step (DDP)"."""
    groups = topo.groups(None)
    return {k: group_mean(g, groups) for k, g in grads.items()}


# --- the inner optimizer ------------------------------------------------------------------


@short_repr
@dataclasses.dataclass(frozen=True)
class InnerConfig:
    """The local (inner) optax optimizer.

    kind: "sgd" (``optax.sgd(lr)``), "momentum" / "nesterov" (``optax.sgd(lr, momentum,
    nesterov=...)``) or "adam" (``optax.adam(lr, b1, b2, eps)``). ``grad_norm``: a
    ``grad_norm_ema`` transformation in front (a floating scalar state leaf that is not
    shaped like the params).
    """

    kind: str
    lr: float = 0.1
    momentum: float = 0.9
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_norm: bool = False


def inner_init(cfg: InnerConfig, params: Tree) -> dict[str, Any]:
    """The inner state, by component name: params-shaped parts are dicts like the params
    ("trace", "mu", "nu"); the others are per-replica arrays ("count", "gn")."""
    zeros = {k: np.zeros_like(v) for k, v in params.items()}
    n = len(next(iter(params.values())))
    state: dict[str, Any] = {}
    if cfg.grad_norm:
        state["gn"] = np.zeros(n, F32)
    if cfg.kind in ("momentum", "nesterov"):
        state["trace"] = zeros
    if cfg.kind == "adam":
        state["count"] = np.zeros(n, np.int32)
        state["mu"] = dict(zeros)
        state["nu"] = {k: v.copy() for k, v in zeros.items()}
    return state


def grad_norm_ema(gn: np.ndarray, grads: Tree) -> np.ndarray:
    """The test's own transformation: ``gn <- 0.5 * gn + sum over leaves of sum(g * g)``,
    gradients passed through."""
    total = np.zeros_like(gn)
    for g in grads.values():
        total = total + (g * g).reshape(len(g), -1).sum(axis=1, dtype=F32)
    return F32(0.5) * gn + total


def sgd_update(cfg: InnerConfig, trace: Tree | None, grads: Tree) -> tuple[Tree, Tree | None]:
    """Rule: "optax.sgd(lr) / optax.sgd(lr, momentum=m, nesterov=...): trace <- g +
    m*trace; u = -lr*(g + m*trace_new if nesterov else trace_new)"."""
    lr, m = F32(cfg.lr), F32(cfg.momentum)
    if cfg.kind == "sgd":
        return {k: -lr * g for k, g in grads.items()}, None
    new_trace = {k: g + m * trace[k] for k, g in grads.items()}
    if cfg.kind == "nesterov":
        direction = {k: g + m * new_trace[k] for k, g in grads.items()}
    else:
        direction = new_trace
    return {k: -lr * d for k, d in direction.items()}, new_trace


def adam_update(cfg: InnerConfig, state: dict, grads: Tree) -> tuple[Tree, dict]:
    """optax.adam: mu <- (1-b1) g + b1 mu; nu <- (1-b2) g^2 + b2 nu; count += 1;
    u = -lr * (mu / (1 - b1^count)) / (sqrt(nu / (1 - b2^count)) + eps)."""
    b1, b2 = F32(cfg.b1), F32(cfg.b2)
    mu = {k: (F32(1) - b1) * g + b1 * state["mu"][k] for k, g in grads.items()}
    nu = {k: (F32(1) - b2) * (g * g) + b2 * state["nu"][k] for k, g in grads.items()}
    count = state["count"] + 1
    c1 = (1 - np.float64(cfg.b1) ** count).astype(F32)
    c2 = (1 - np.float64(cfg.b2) ** count).astype(F32)
    updates = {}
    with np.errstate(invalid="ignore"):
        for k in grads:
            shape = (-1,) + (1,) * (grads[k].ndim - 1)
            mu_hat = mu[k] / c1.reshape(shape)
            nu_hat = nu[k] / c2.reshape(shape)
            updates[k] = -F32(cfg.lr) * (mu_hat / (np.sqrt(nu_hat) + F32(cfg.eps)))
    return updates, {"count": count, "mu": mu, "nu": nu}


def inner_update(cfg: InnerConfig, state: dict, grads: Tree) -> tuple[Tree, dict]:
    """One step of the inner optimizer on every replica: ``(updates, new_state)``."""
    state = dict(state)
    with np.errstate(invalid="ignore", over="ignore"):
        if cfg.grad_norm:
            state["gn"] = grad_norm_ema(state["gn"], grads)
        if cfg.kind == "adam":
            updates, adam = adam_update(cfg, state, grads)
            state.update(adam)
        else:
            updates, trace = sgd_update(cfg, state.get("trace"), grads)
            if trace is not None:
                state["trace"] = trace
    return updates, state


# --- the averagers ------------------------------------------------------------------------


@short_repr
@dataclasses.dataclass(frozen=True)
class OuterConfig:
    """An outer ``optax.sgd(lr, momentum, nesterov)``."""

    lr: float
    momentum: float | None = None
    nesterov: bool = False


@short_repr
@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """``comm.quantized(bits, block_size, error_feedback, two_level)``, inner axis "local"."""

    bits: int = 8
    block_size: int = 64
    error_feedback: bool = True
    two_level: bool = False


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
    cfg: OuterConfig, anchor: np.ndarray, mean: np.ndarray, trace: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Rule: "pseudo_grad = anchor - m; (upd, outer_state) = outer.update(pseudo_grad,
    outer_state, anchor); new = anchor + upd (computed as m + (pseudo_grad + upd), so
    optax.sgd(1.0) gives m exactly)". Returns ``(new, new_trace)``."""
    pseudo = anchor - mean
    lr = F32(cfg.lr)
    if cfg.momentum is None:
        upd = -lr * pseudo
    else:
        m = F32(cfg.momentum)
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
            new, trace = outer_step(cfg, anchor[k][r], v[r], trace)
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


# --- a run --------------------------------------------------------------------------------


@short_repr
@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One run of the library, in one of the four ways of calling it.

    path: "functional" (hook -> inner -> apply_updates -> average_parameters in a
    shard_map), "model_averaging" (``optax.chain(hook, inner, model_averaging)``),
    "optimizer" (``optax.chain(hook, post_local_sgd_optimizer(inner, averager, ...))``)
    or "step" (``data_parallel_step`` of the chain ``step_tx``).
    hook: None for none (``data_parallel_step`` then averages gradients, DDP).
    averager: None for none (``step`` only).
    opt_state_mask: "none", "all" (a tree of True) or "arrays" (a callable: every leaf
    with ndim > 0): which inner-state leaves ``post_local_sgd_optimizer`` averages.
    step_tx: for "step": "model_averaging", "optimizer" or "inner" (no averager).
    multi_steps: for "step": ``optax.MultiSteps(chain, every_k_schedule=k)`` when > 1.
    model_state: for "step": ``with_model_state=True``.
    int_leaf / complex_leaf: for "functional": an int32 and a complex64 params leaf,
    moved by the test itself, never by the optimizer.
    specialize / lowering: for "step": how ``data_parallel_step`` compiles the step;
    the documented numbers are the same for every choice, so the model ignores them.
    """

    topo: Topology
    path: str
    hook: HookConfig | None
    inner: InnerConfig
    averager: AveragerConfig | None
    opt_state_mask: str = "none"
    step_tx: str = ""
    multi_steps: int = 1
    model_state: bool = False
    int_leaf: bool = False
    complex_leaf: bool = False
    specialize: bool | str = True
    lowering: str = "shard_map"


@dataclasses.dataclass
class Batch:
    """One step's data, per replica: the loss is ``0.5 * sum(c * (w - d)**2)`` summed over
    the float leaves (gradient ``c * (w - d)``); ``e`` feeds the model state; ``n_inc`` and
    ``z_inc`` move the int and complex leaves of the functional path."""

    c: Tree
    d: Tree
    e: np.ndarray
    n_inc: np.ndarray
    z_inc: np.ndarray


def gradients(params: Tree, batch: Batch) -> Tree:
    """Rule: "Gradients g_r of a simple per-replica loss at its params": c * (w - d)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return {k: batch.c[k] * (params[k] - batch.d[k]) for k in batch.c}


def loss_value(params: Tree, batch: Batch) -> np.float32:
    """The loss ``data_parallel_step`` returns: the mean over replicas of each replica's
    ``sum over leaves of 0.5 * sum(c * (w - d)**2)``."""
    with np.errstate(invalid="ignore", over="ignore"):
        per = 0.0
        for k in batch.c:
            diff = params[k].astype(np.float64) - batch.d[k]
            per = per + 0.5 * (batch.c[k] * diff**2).reshape(len(diff), -1).sum(axis=1)
        return F32(np.mean(per))


def model_state_step(model_state: Tree, batch: Batch) -> Tree:
    """The test's model state, updated inside loss_fn from the batch: ``stat <- 0.5 *
    stat + e`` (float32), ``count <- count + 1`` (int32, never averaged)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return {
            "count": model_state["count"] + np.int32(1),
            "stat": F32(0.5) * model_state["stat"] + batch.e,
        }


def chosen_components(cfg: RunConfig, inner_state: dict) -> dict[str, Any]:
    """The inner-state components that ``average_opt_state`` selects: "all": every one;
    "arrays": those whose leaves have ndim > 0 (the params-shaped ones)."""
    if cfg.path not in ("optimizer", "step") or cfg.opt_state_mask == "none":
        return {}
    if cfg.path == "step" and cfg.step_tx != "optimizer":
        return {}
    if cfg.opt_state_mask == "all":
        return dict(inner_state)
    return {k: v for k, v in inner_state.items() if isinstance(v, dict)}


@dataclasses.dataclass
class Replay:
    """Everything the model carries from step to step."""

    params: Tree
    hook_iter: int
    inner: dict
    averager: AveragerState | None
    model_state: Tree
    acc: Tree | None = None
    mini_step: int = 0
    gradient_step: int = 0


def _chain_step(cfg: RunConfig, rp: Replay, grads: Tree) -> tuple[Tree, Replay, Averaged | None]:
    """hook -> inner -> averager, as ``model_averaging`` / ``post_local_sgd_optimizer``
    see it: returns the params after ``apply_updates`` and the next states.

    Rule (paths): "model_averaging / post_local_sgd_optimizer instead turn the update into
    u' = new - p so that apply_updates gives p + (new - p) ... On non-averaging or skipped
    steps u passes unchanged"; chosen inner-state leaves are "assigned the mean (not via
    updates)".
    """
    rp = dataclasses.replace(rp)
    if cfg.hook is not None:
        grads, rp.hook_iter = hook_step(cfg.hook, rp.hook_iter, grads, cfg.topo)
    updates, rp.inner = inner_update(cfg.inner, rp.inner, grads)
    p = rp.params
    with np.errstate(invalid="ignore", over="ignore"):
        stepped = {k: (p[k] + updates[k]).astype(p[k].dtype) for k in p}
        if rp.averager is None:
            return stepped, rp, None
        chosen = chosen_components(cfg, rp.inner)
        avg, rp.averager = average_call(cfg.averager, rp.averager, stepped, cfg.topo, chosen)
        new_params = {}
        for k in p:
            via_updates = p[k] + (avg.params[k] - p[k])
            new_params[k] = np.where(avg.assigned[k], via_updates, stepped[k]).astype(p[k].dtype)
    rp.inner = {**rp.inner, **avg.extra}
    return new_params, rp, avg


def _snapshot(cfg: RunConfig, rp: Replay, loss: Any) -> Snapshot:
    """The observable state after a step, by the names the tests read back."""
    snap: Snapshot = {f"params/{k}": v.copy() for k, v in rp.params.items()}
    if cfg.hook is not None:
        snap["hook/iter"] = np.full(cfg.topo.size, rp.hook_iter, np.int32)
    for name, c in rp.inner.items():
        if isinstance(c, dict):
            snap.update({f"inner/{name}/{k}": v.copy() for k, v in c.items()})
        else:
            snap[f"inner/{name}"] = c.copy()
    if rp.averager is not None:
        a, acfg = rp.averager, cfg.averager
        snap["averager/step"] = np.full(cfg.topo.size, a.step, np.int32)
        if a.anchor is not None:
            for k, v in a.anchor.items():
                if is_floating(v):
                    snap[f"averager/anchor/{k}"] = v.copy()
        if acfg.outer is not None:
            snap["averager/outer_count"] = a.outer_count.copy()
            if a.outer_trace is not None:
                snap.update(
                    {f"averager/outer_trace/{k}": v.copy() for k, v in a.outer_trace.items()}
                )
        for name in ("residual", "inflight_start", "inflight_mean"):
            tree = getattr(a, name)
            if tree is not None:
                snap.update(
                    {f"averager/{name}/{k}": v.copy() for k, v in tree.items() if is_floating(v)}
                )
        if isinstance(acfg.period, str) and acfg.kind == "periodic":
            snap["averager/last_sync"] = np.full(cfg.topo.size, a.last_sync, np.int32)
    if cfg.model_state:
        snap.update({f"model_state/{k}": v.copy() for k, v in rp.model_state.items()})
    if cfg.multi_steps > 1:
        snap["multi_steps/mini_step"] = np.full(cfg.topo.size, rp.mini_step, np.int32)
        snap["multi_steps/gradient_step"] = np.full(cfg.topo.size, rp.gradient_step, np.int32)
    if loss is not None:
        snap["loss"] = np.asarray(loss, F32)
    return snap


def initial_replay(cfg: RunConfig, params0: Tree, model_state0: Tree | None = None) -> Replay:
    """Every replica starts from the same params; all counters at 0."""
    n = cfg.topo.size
    params = {k: np.broadcast_to(v, (n, *v.shape)).copy() for k, v in params0.items()}
    trainable = {k: v for k, v in params.items() if k in TRAINABLE}
    averager = averager_init(cfg.averager, params) if cfg.averager is not None else None
    ms = model_state0 or {"count": np.zeros((), np.int32), "stat": np.zeros(2, F32)}
    ms = {k: np.broadcast_to(v, (n, *np.shape(v))).copy() for k, v in ms.items()}
    acc = {k: np.zeros_like(v) for k, v in trainable.items()} if cfg.multi_steps > 1 else None
    return Replay(params, 0, inner_init(cfg.inner, trainable), averager, ms, acc)


def simulate(cfg: RunConfig, params0: Tree, batches: list[Batch]) -> tuple[list[Snapshot], list]:
    """Replays the run; returns one Snapshot per step, and per step the groups that
    ``average_parameters`` assigned (functional path: bitwise-identical members)."""
    rp = initial_replay(cfg, params0)
    snaps, assigned = [], []
    for batch in batches:
        train = {k: v for k, v in rp.params.items() if k in batch.c}
        loss = loss_value(train, batch) if cfg.path == "step" else None
        grads = gradients(train, batch)
        avg = None
        if cfg.path == "functional":
            rp, avg = _functional_step(cfg, rp, grads, batch)
        elif cfg.path in ("model_averaging", "optimizer"):
            rp, avg = _updates_step(cfg, rp, grads)
        else:
            rp, avg = _data_parallel_step(cfg, rp, grads, batch)
        snaps.append(_snapshot(cfg, rp, loss))
        assigned.append(avg.bitwise_groups if avg is not None else [])
    return snaps, assigned


def _functional_step(cfg: RunConfig, rp: Replay, grads: Tree, batch: Batch):
    """Path (a): hook -> inner update -> optax.apply_updates -> average_parameters, which
    "ASSIGNS the mean (bitwise-identical replicas)". The int leaf grows by ``n_inc`` and
    the complex leaf by ``z_inc`` before the average."""
    rp = dataclasses.replace(rp)
    grads, rp.hook_iter = hook_step(cfg.hook, rp.hook_iter, grads, cfg.topo)
    updates, rp.inner = inner_update(cfg.inner, rp.inner, grads)
    p = dict(rp.params)
    with np.errstate(invalid="ignore", over="ignore"):
        for k in updates:
            p[k] = (p[k] + updates[k]).astype(p[k].dtype)
    if "n" in p:
        p["n"] = p["n"] + batch.n_inc
    if "z" in p:
        p["z"] = (p["z"] + batch.z_inc).astype(np.complex64)
    avg, rp.averager = average_call(cfg.averager, rp.averager, p, cfg.topo)
    rp.params = avg.params
    return rp, avg


def _updates_step(cfg: RunConfig, rp: Replay, grads: Tree):
    """Paths (b) and (c): the chain, then ``optax.apply_updates``."""
    params, rp, avg = _chain_step(cfg, rp, grads)
    rp.params = params
    return rp, avg


def _data_parallel_step(cfg: RunConfig, rp: Replay, grads: Tree, batch: Batch):
    """Path (d): ``data_parallel_step``: DDP gradient mean when there is no hook; the
    chain (under MultiSteps: accumulate, and the chain "only takes effect on every k-th
    mini-step"); model state averaged where the averager really averaged."""
    rp = dataclasses.replace(rp)
    if cfg.hook is None:
        grads = ddp_mean(grads, cfg.topo)
    new_ms = model_state_step(rp.model_state, batch)
    avg = None
    if cfg.multi_steps > 1:
        emit = rp.mini_step == cfg.multi_steps - 1
        n = F32(rp.mini_step + 1)
        acc = {k: rp.acc[k] + (g - rp.acc[k]) / n for k, g in grads.items()}
        if emit:
            params, rp, avg = _chain_step(cfg, rp, acc)
            rp.params = params
            rp.acc = {k: np.zeros_like(v) for k, v in acc.items()}
            rp.gradient_step += 1
        else:
            rp.acc = acc  # nothing took effect on this mini-step: avg stays None
        rp.mini_step = (rp.mini_step + 1) % cfg.multi_steps
    else:
        params, rp, avg = _chain_step(cfg, rp, grads)
        rp.params = params
    if cfg.averager is not None:
        new_ms = average_model_state(cfg.averager, avg, new_ms)
    rp.model_state = new_ms
    return rp, avg
