"""The option space of the averagers and the hook as cases, and the model's replay of one.

An ``Option`` sets a few fields of a ``Case`` (the base case: post-local SGD switching at
step 2, momentum SGD inside, ``PeriodicModelAverager(2, warmup_steps=2)``, 2 x 4
replicas). Options on one ``axis`` are alternatives (two communication strategies, two
fragment counts), so a pair takes its options from two different axes. ``refusal``
says, from the documented rules, which pairs the constructors refuse and what the
message names; ``not_applicable`` which pairs have no meaning (an option a constructor
does not take, model state where a door has no way to carry it). ``assign_doors``
sends each of many cases through one door so that every option meets every door.

``replay`` runs a case through the specification model (``spec_model``): the hook, the
inner momentum SGD and ``model_averaging``'s update path, step by step, with the
model's own averager (``spec_model.average_call``) and model-state rule. What the model
of tests/spec/ leaves out is written here from the documentation: the hook's
``communication=`` (``post_localSGD_hook``'s docstring), leaves narrower than float32
(each operation rounds to the leaf's dtype, as JAX's bfloat16 arithmetic does; the
model's ``is_floating`` is widened to bfloat16 for the replay) and scalar leaves (they
ride as shape (1,)).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any

import ml_dtypes
import numpy as np
import spec_model as M
import spec_model.averagers

F32 = np.float32
BF16 = ml_dtypes.bfloat16
AXES = ("node", "local")
STEPS = 10  # covers the switch, several averages, a delayed landing, every fragment once
LR, MOMENTUM = 0.1, 0.9  # the inner optax.sgd(LR, momentum=MOMENTUM)

# One replica's model: 9 leaves of mixed shapes and dtypes, 462 values (tree order is
# the sorted names).
LEAVES: dict[str, tuple[tuple[int, ...], Any]] = {
    "a_scale": ((), F32),
    "b_bias": ((37,), F32),
    "c_dense": ((10, 13), F32),
    "d_conv": ((3, 5, 8), F32),
    "e_embed": ((48,), BF16),
    "f_proj": ((8, 12), BF16),
    "g_gate": ((), BF16),
    "h_head": ((5,), F32),
    "i_mix": ((2, 3, 4), BF16),
}
NONFINITE_LEAF = "b_bias"  # where a NaN goes in when a case has a non-finite policy

QUANTS = {
    "q8": M.QuantConfig(8, 16),
    "q4": M.QuantConfig(4, 16),
    "q8_two_level": M.QuantConfig(8, 16, two_level=True),
    "q8_no_feedback": M.QuantConfig(8, 16, error_feedback=False),
}
COMMS = ("flat", "finite_only", "compressed", "two_level", *QUANTS)  # averager communication=
HOOK_COMMS = ("two_level", "compressed", "q8", "q8_two_level")  # hook communication=
OUTER = M.OuterConfig(0.7, momentum=0.9, nesterov=True)  # DiLoCo's outer Nesterov
HIERARCHY = ((2, ("local",)), (4, None))  # HierarchicalModelAverager({2: "local", 4: None})
ADAPTIVE = "3_then_2"  # a callable period: 3 until step 6, then 2 (spec_model.SCHEDULES)


@dataclasses.dataclass(frozen=True)
class Case:
    """One combination of options (the defaults are the base case).

    schedule: "periodic", "hierarchical" (``HIERARCHY``) or "adaptive" (a callable
    period). period: ``2 * fragments`` for a periodic averager, so that each fragment
    averages every 2 steps and ``delay=1`` fits. comm: an averager ``communication=``
    (``COMMS``); comm_dtype: ``communication_dtype=jnp.bfloat16`` (the flag spelling).
    group: a process_group named: "node" (periodic: ``("node",)``, the replicas with
    the same local index across nodes; hierarchical: every level's axes and the global
    ones named) or "local" (periodic: ``("local",)``, inside each node only). outer: "skip_first" or
    "from_init" (``outer_skip_first=False``).
    """

    options: tuple[str, ...] = ()
    shape: tuple[int, int] = (2, 4)
    schedule: str = "periodic"
    fragments: int = 1
    warmup: int = 2
    delay: int = 0
    delta: bool = False
    outer: str | None = None
    offload: bool = False
    nonfinite: str = "propagate"
    comm: str | None = None
    comm_dtype: bool = False
    group: str | None = None
    hook_start: int = 2
    hook_allreduce: bool = True
    hook_comm: str | None = None
    model_state: bool = False

    @property
    def period(self) -> int:
        return 2 * self.fragments

    @property
    def first_global_step(self) -> int:
        """The step of the first global average (a hierarchy's: the first multiple of its
        last period from the warm-up on)."""
        if self.schedule == "hierarchical":
            last = HIERARCHY[-1][0]
            return -(-self.warmup // last) * last
        return self.warmup

    @property
    def topo(self) -> M.Topology:
        return M.Topology(AXES, self.shape)

    @property
    def injects_nonfinite(self) -> bool:
        """A NaN in one replica's data after the switch: what a non-finite policy acts on."""
        return self.nonfinite != "propagate" or self.comm == "finite_only"

    @property
    def id(self) -> str:
        name = "+".join(self.options) or "base"
        return name if self.shape == (2, 4) else f"{name}@{self.shape[0]}x{self.shape[1]}"

    def __repr__(self) -> str:  # what a failing test prints
        return f"Case({self.id})"


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    axis: str
    changes: tuple[tuple[str, Any], ...]


def _option(name: str, axis: str, **changes: Any) -> Option:
    return Option(name, axis, tuple(changes.items()))


OPTIONS: tuple[Option, ...] = (
    # the averager's schedule (constructor arguments)
    _option("hierarchical", "schedule", schedule="hierarchical"),
    _option("adaptive", "schedule", schedule="adaptive"),
    _option("frag2", "fragments", fragments=2),
    _option("frag3", "fragments", fragments=3),
    _option("frag4", "fragments", fragments=4),
    _option("group_node", "group", group="node"),
    _option("group_local", "group", group="local"),
    # the averager's options (_config._options())
    _option("delay", "delay", delay=1),
    _option("delta", "delta", delta=True),
    _option("outer", "outer", outer="skip_first"),
    _option("outer_from_init", "outer", outer="from_init"),
    _option("offload", "offload", offload=True),
    _option("exclude", "nonfinite", nonfinite="exclude"),
    _option("skip", "nonfinite", nonfinite="skip"),
    *(_option(f"comm_{c}", "comm", comm=c) for c in COMMS),
    _option("comm_dtype", "comm", comm_dtype=True),
    # the hook
    _option("start0", "start", hook_start=0, warmup=0),
    _option("start3", "start", hook_start=3, warmup=3),
    _option("no_node_mean", "hook_allreduce", hook_allreduce=False),
    *(_option(f"hook_{c}", "hook_comm", hook_comm=c) for c in HOOK_COMMS),
    # the step
    _option("model_state", "model_state", model_state=True),
)
BY_NAME = {o.name: o for o in OPTIONS}


def case_of(*names: str, shape: tuple[int, int] = (2, 4)) -> Case:
    """The base case with the options ``names`` (on different axes)."""
    fields: dict[str, Any] = {}
    axes = [BY_NAME[n].axis for n in names]
    assert len(set(axes)) == len(axes), f"options {names} share an axis"
    for n in names:
        fields.update(BY_NAME[n].changes)
    return Case(options=tuple(names), shape=shape, **fields)


def singles() -> list[Case]:
    return [case_of(o.name) for o in OPTIONS]


def pairs() -> list[Case]:
    """Every pair of options from two different axes, in ``OPTIONS`` order."""
    both = itertools.combinations(OPTIONS, 2)
    return [case_of(a.name, b.name) for a, b in both if a.axis != b.axis]


# What a door costs to compile, roughly (one program; a program per phase; a step built
# twice): once every option has met every door, the cheaper doors take the rest.
DOOR_COST = {"user_shard_map": 1, "stacked": 1, "cond-jit": 1, "cond-shard_map": 1,
             "switch-jit": 2, "switch-shard_map": 2}  # fmt: skip


def assign_doors(cases: list[Case], doors: tuple[str, ...], runs) -> list[tuple[Case, str]]:
    """Each case that ``runs(case, door)`` through one door: the door that meets the
    most (option, door) pairs not met yet, then the cheapest to compile
    (:data:`DOOR_COST`), then the least used one, then the first. So every option goes
    through every door it can, and the cheap doors take the rest of the work."""
    met: set[tuple[str, str]] = set()
    used = dict.fromkeys(doors, 0)
    out = []
    for case in cases:
        options = case.options or ("base",)
        candidates = [d for d in doors if runs(case, d)]
        if not candidates:
            continue
        door = min(
            candidates,
            key=lambda d: (
                -sum((o, d) not in met for o in options),
                DOOR_COST.get(d, 3),
                used[d],
                doors.index(d),
            ),
        )
        met.update((o, door) for o in options)
        used[door] += 1
        out.append((case, door))
    return out


# --- what the constructors refuse, and what has no meaning -----------------------------

DOORS_WITHOUT_MODEL_STATE = ("stacked", "user_shard_map")
"""Doors with no way to carry model state (lsgd_jax.stacked and a user's own step take
params and optimizer state only; averaging model state like the params is
data_parallel_step's)."""


def refusal(case: Case) -> tuple[type, tuple[str, ...]] | None:
    """``(exception type, words its message must hold)`` for a case the constructors
    refuse by their documented rules, or None.

    - "fragments with an outer_optimizer is not supported";
    - a callable period: "fragments and delay need an int period";
    - "Give either communication= or nonfinite=/communication_dtype=";
    - "communication_dtype works with nonfinite='propagate' only".
    """
    if case.fragments > 1 and case.outer is not None:
        return ValueError, ("fragments", "outer_optimizer")
    if case.schedule == "adaptive" and (case.fragments > 1 or case.delay):
        return ValueError, ("int period", f"fragments={case.fragments}", f"delay={case.delay}")
    if case.comm is not None and case.nonfinite != "propagate":
        return ValueError, ("communication=", "nonfinite=", repr(case.nonfinite))
    if case.comm_dtype and case.nonfinite != "propagate":
        return ValueError, ("communication_dtype", "propagate", repr(case.nonfinite))
    return None


def runs(case: Case, door: str) -> bool:
    """Whether ``case`` runs through ``door`` (neither refused nor without meaning)."""
    return refusal(case) is None and not not_applicable(case, door)


def not_applicable(case: Case, door: str | None = None) -> str | None:
    """Why ``case`` (through ``door``) has no meaning, or None."""
    if case.schedule == "hierarchical" and case.fragments > 1:
        return "HierarchicalModelAverager takes no fragments"
    if case.schedule == "hierarchical" and case.group == "local":
        return "a HierarchicalModelAverager's last group is the global one"
    if door in DOORS_WITHOUT_MODEL_STATE and case.model_state:
        return f"the {door} door carries no model state"
    return None


# --- data ---------------------------------------------------------------------------------


def initial_params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(F32).astype(d) for k, (s, d) in LEAVES.items()}


def initial_model_state() -> dict[str, np.ndarray]:
    return {"count": np.zeros((), np.int32), "stat": np.zeros(2, F32)}


def batches(case: Case, seed: int = 0) -> list[M.Batch]:
    """Per step: ``c`` and ``d`` of the loss ``0.5 * sum(c * (w - d)**2)`` per leaf, and
    ``e`` for the model state, per replica; with a non-finite policy a NaN in replica 5's
    ``d`` one step after the switch (so only its node's gradients, not everyone's)."""
    rng = np.random.default_rng(seed + 1)
    n, out = case.topo.size, []
    for t in range(STEPS):
        c = {k: rng.uniform(0.5, 1.5, (n, *s)).astype(F32) for k, (s, _) in LEAVES.items()}
        d = {k: rng.standard_normal((n, *s)).astype(F32) for k, (s, _) in LEAVES.items()}
        e = rng.standard_normal((n, 2)).astype(F32)
        if case.injects_nonfinite and t == case.hook_start + 1:
            d[NONFINITE_LEAF][5, 3] = np.nan
        out.append(M.Batch(c, d, e, None, None))
    return out


# --- the model's replay -------------------------------------------------------------------


def averager_config(case: Case) -> M.AveragerConfig:
    """The spec model's averager for the case (communication= spelled as the model's
    options: finite_only as a policy, compressed as bf16, two_level as an exact mean)."""
    common = dict(
        warmup=case.warmup,
        nonfinite="exclude" if case.comm == "finite_only" else case.nonfinite,
        outer=OUTER if case.outer else None,
        outer_skip_first=case.outer != "from_init",
        bf16=case.comm == "compressed" or case.comm_dtype,
        delta=case.delta,
        delay=case.delay,
        quant=QUANTS.get(case.comm),
    )
    if case.schedule == "hierarchical":
        levels = HIERARCHY
        if case.group == "node":
            levels = tuple((p, g or AXES) for p, g in HIERARCHY)
        return M.AveragerConfig("hierarchical", levels=levels, **common)
    return M.AveragerConfig(
        "periodic",
        period=ADAPTIVE if case.schedule == "adaptive" else case.period,
        process_group=(case.group,) if case.group else None,
        fragments=case.fragments,
        **common,
    )


def _flat(tree: dict, names: list[str], r: int) -> np.ndarray:
    return np.concatenate([np.ravel(tree[k][r]).astype(F32) for k in names])


def _unflat(buf: np.ndarray, like: dict, names: list[str]) -> dict:
    out, offset = {}, 0
    for k in names:
        size = like[k][0].size
        out[k] = buf[offset : offset + size].reshape(like[k][0].shape)
        offset += size
    return out


def hook_mean(case: Case, grads: dict, axes: tuple[str, ...], residual: dict | None):
    """The hook's mean over the groups of ``axes`` with its ``communication=``.

    Rules (post_localSGD_hook, comm): flat and two_level: the exact mean; compressed:
    the bfloat16 mean; quantized: "the floating leaves flattened into one float32
    buffer (with error feedback, plus this replica's residual)", the quantized mean, and
    the residual kept per replica; "with two_level=True a node-local mean never leaves
    the node: it is an exact float32 mean and leaves the residual alone". Returns
    ``(grads, residual)``.
    """
    topo, comm = case.topo, case.hook_comm
    groups = topo.groups(axes)
    if comm in (None, "two_level"):
        return {k: M.group_mean(g, groups) for k, g in grads.items()}, residual
    if comm == "compressed":
        out = {k: g.copy() for k, g in grads.items()}
        for members in groups:
            for k in out:
                out[k][members] = M.bf16_mean(grads[k][members])
        return out, residual
    q = QUANTS[comm]
    if q.two_level and tuple(axes) == ("local",):
        return {k: M.group_mean(g, groups) for k, g in grads.items()}, residual
    inner = topo.shape[1] if q.two_level and "local" in axes and len(axes) > 1 else 1
    names = sorted(grads)
    out = {k: g.copy() for k, g in grads.items()}
    new_residual = None if residual is None else {k: v.copy() for k, v in residual.items()}
    for members in groups:
        values = np.stack([_flat(grads, names, r) for r in members])
        with np.errstate(invalid="ignore", over="ignore"):
            if residual is not None:
                values = values + np.stack([_flat(residual, names, r) for r in members])
            mean, res = M.quantized_group_mean(values, q, inner)
        for k, v in _unflat(mean, grads, names).items():
            out[k][members] = v.astype(grads[k].dtype)
        if new_residual is not None:
            for i, r in enumerate(members):
                for k, v in _unflat(res[i], grads, names).items():
                    new_residual[k][r] = v
    return out, new_residual


def gradients(params: dict, batch: M.Batch) -> dict:
    """``c * (w - d)`` in float32, rounded to the leaf's dtype (the cotangent of ``w``'s
    cast to float32 in the loss)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return {
            k: (batch.c[k] * (p.astype(F32) - batch.d[k])).astype(p.dtype)
            for k, p in params.items()
        }


def momentum_sgd(trace: dict, grads: dict) -> tuple[dict, dict]:
    """optax.sgd(LR, momentum=MOMENTUM) in each leaf's dtype: ``trace <- g + m trace``,
    ``u = -lr trace`` (the Python constants taken in the leaf's dtype, as JAX's weak types
    do)."""
    updates, new_trace = {}, {}
    with np.errstate(invalid="ignore", over="ignore"):
        for k, g in grads.items():
            t = g + g.dtype.type(MOMENTUM) * trace[k]
            new_trace[k] = t
            updates[k] = g.dtype.type(-LR) * t
    return updates, new_trace


def is_floating(x: np.ndarray) -> bool:
    """spec_model's rule ("only floating leaves are averaged"), bfloat16 included:
    ``np.issubdtype(ml_dtypes.bfloat16, np.inexact)`` is False, so the model's own test
    would leave bfloat16 leaves out of every average."""
    return M.is_floating(x) or x.dtype == BF16


@contextlib.contextmanager
def narrow_floats():
    """spec_model's averagers with ``is_floating`` above, for the replay only."""
    saved = spec_model.averagers.is_floating
    spec_model.averagers.is_floating = is_floating
    try:
        yield
    finally:
        spec_model.averagers.is_floating = saved


@dataclasses.dataclass
class Snapshot:
    """The model after one step: every replica's params (and model state)."""

    params: dict[str, np.ndarray]
    model_state: dict[str, np.ndarray] | None


def replay(case: Case, params0: dict, data: list[M.Batch]) -> list[Snapshot]:
    """The case's run in the model: ``optax.chain(post_local_sgd, sgd(momentum),
    model_averaging(averager))`` through ``data_parallel_step``, one Snapshot a step."""
    with narrow_floats():
        return _replay(case, params0, data)


def _per_replica(tree: dict, n: int) -> dict:
    """Each leaf stacked for ``n`` replicas; a scalar as shape (1,): spec_model assigns
    through ``x[r][mask]``, which a scalar leaf's ``x[r]`` (a NumPy scalar) cannot take
    (the same positions in the flat order, so the same fragments)."""
    return {k: np.broadcast_to(v, (n, *(np.shape(v) or (1,)))).copy() for k, v in tree.items()}


def _replay(case: Case, params0: dict, data: list[M.Batch]) -> list[Snapshot]:
    topo, n = case.topo, case.topo.size
    params = _per_replica(params0, n)
    trace = {k: np.zeros_like(v) for k, v in params.items()}
    cfg = averager_config(case)
    avg_state = M.averager_init(cfg, params)
    hook_iter, hook_residual = 0, None
    if case.hook_comm in QUANTS and QUANTS[case.hook_comm].error_feedback:
        hook_residual = {k: np.zeros(v.shape, F32) for k, v in params.items()}
    model_state = _per_replica(initial_model_state(), n)
    model_state["count"] = model_state["count"][:, 0]  # stays an int32 scalar a replica
    out = []
    for batch in data:
        c, d = ({k: v.reshape(params[k].shape) for k, v in x.items()} for x in (batch.c, batch.d))
        grads = gradients(params, M.Batch(c, d, batch.e, None, None))
        if case.hook_start > 0 and hook_iter < case.hook_start:  # M.hook_step's rule
            grads, hook_residual = hook_mean(case, grads, AXES, hook_residual)
            hook_iter += 1
        elif case.hook_allreduce:
            grads, hook_residual = hook_mean(case, grads, ("local",), hook_residual)
        updates, trace = momentum_sgd(trace, grads)
        with np.errstate(invalid="ignore", over="ignore"):
            stepped = {k: p + updates[k] for k, p in params.items()}
            avg, avg_state = M.average_call(cfg, avg_state, stepped, topo)
            # model_averaging's update u' = new - p where it averaged (M._chain_step)
            params = {
                k: np.where(avg.assigned[k], p + (avg.params[k] - p), stepped[k]).astype(p.dtype)
                for k, p in params.items()
            }
        model_state = M.average_model_state(cfg, avg, M.model_state_step(model_state, batch))
        given = {k: v.reshape(n, *np.shape(params0[k])) for k, v in params.items()}
        out.append(Snapshot(given, model_state if case.model_state else None))
    return out


def tolerance(case: Case, dtype: Any) -> float:
    """tests/spec/test_spec.py's: a few float32 ulps of the values' scale; a bfloat16 ulp
    or two where bfloat16 is involved (a bfloat16 leaf, or a mean sent in bfloat16).

    With a quantized mean, two grid steps of a block (``2 / qmax`` of its largest value):
    the model replays the quantizer exactly, but its inputs differ from the library's
    by the order of float32 sums and by bfloat16 roundings (XLA keeps more precision
    inside a fusion than one rounding per operation), and a block mixes leaves, so a
    value that sits on a rounding boundary, or a block whose scale moved by a bfloat16
    ulp, rounds one grid step the other way (tests/spec's trees are too small to meet
    one; these 462 values meet a few per run).

    A bfloat16 leaf with an outer optimizer: eight bfloat16 ulps of the scale. Its
    Nesterov step rounds the pseudo-gradient ``anchor - mean`` (of the order of the
    params when the outer step starts from init) and adds ``lr (1 + m)`` times it back,
    so a rounding of the pseudo-gradient moves the params about 2.3 ulps, a few per
    step (all doors agree to the bit; the model's differs from XLA's fused bfloat16
    arithmetic by 2^-5 after two outer steps in ``outer_from_init+start0``).
    """
    bf16 = dtype == BF16 or "compressed" in (case.comm, case.hook_comm) or case.comm_dtype
    rel = 2.0**-6 if bf16 else 2e-5
    if dtype == BF16 and case.outer is not None:
        rel = 2.0**-4
    for name in (case.comm, case.hook_comm):
        if name in QUANTS:
            rel = max(rel, 2.0 / M.QMAX[QUANTS[name].bits])
    return rel
