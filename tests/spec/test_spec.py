"""The executable specification: the library against the NumPy model in tests/spec_model/.

Hypothesis draws meshes (size-1 axes and three levels included), hook and averager
options (delayed averages and quantized means among them), inner optimizers, NaN/Inf
injections and step counts, runs the library in each of the four ways of calling it,
and compares every replica's params, the optimizer-state leaves the model names
(momentum, Adam moments, hook iter, averager step, anchor, outer momentum, outer_count,
last_sync, the quantized mean's residual, the delayed average in flight), model state
and loss with the model after EVERY step.

Profiles (env var LSGD_SPEC_PROFILE): "ci" (default: few examples, derandomized, fast)
and "thorough" (20 times as many, random).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import spec_model as M
from helpers import squeeze, unsqueeze
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import lsgd_jax

# Advice that data_parallel_step gives on configurations drawn here on purpose.
pytestmark = [
    pytest.mark.slow,  # the slow tier: 233 s on 2 workers (2026-12-01)
    pytest.mark.filterwarnings("ignore:.*has warmup_steps=.*:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*inside the subgroup over which post_local_sgd"),
]

# --- profiles -----------------------------------------------------------------------------

PROFILE = os.environ.get("LSGD_SPEC_PROFILE", "ci")
if PROFILE not in ("ci", "thorough"):
    raise ValueError(f"LSGD_SPEC_PROFILE must be 'ci' or 'thorough', got {PROFILE!r}.")
SCALE = 20 if PROFILE == "thorough" else 1


def spec_settings(examples: int) -> settings:
    return settings(
        max_examples=examples * SCALE,
        deadline=None,
        derandomize=PROFILE == "ci",
        database=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )


@pytest.fixture(autouse=True)
def quiet_library_logger():
    """No warning callbacks compiled in, nothing printed (restored afterwards)."""
    logger = logging.getLogger("lsgd_jax")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


# --- meshes -------------------------------------------------------------------------------

TWO = ("node", "local")
THREE = ("pod", "node", "local")
TOPOLOGIES = [
    M.Topology(TWO, (2, 4)),
    M.Topology(TWO, (4, 2)),
    M.Topology(TWO, (1, 8)),
    M.Topology(TWO, (8, 1)),
    M.Topology(TWO, (1, 1)),
    M.Topology(THREE, (2, 2, 2)),
    M.Topology(THREE, (2, 1, 4)),
    M.Topology(THREE, (1, 2, 4)),
]


@functools.cache
def mesh_of(topo: M.Topology) -> jax.sharding.Mesh:
    if topo.names == TWO:
        return lsgd_jax.make_mesh(*topo.shape)
    devices = np.array(jax.devices()[: topo.size]).reshape(topo.shape)
    return jax.sharding.Mesh(devices, topo.names)


def fetch(tree):
    """Host copies (the step donates its inputs)."""
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


# --- the library objects for a config -----------------------------------------------------


class GradNormState(NamedTuple):
    gn: jax.Array


def grad_norm_ema() -> optax.GradientTransformation:
    """A floating scalar state leaf not shaped like the params: gn <- 0.5 gn + sum g^2."""

    def init(params):
        del params
        return GradNormState(jnp.zeros([], jnp.float32))

    def update(updates, state, params=None):
        del params
        total = sum(jnp.sum(g * g) for g in jax.tree.leaves(updates))
        return updates, GradNormState(0.5 * state.gn + total)

    return optax.GradientTransformation(init, update)


SCHEDULE_FNS = {
    "3_then_2": lambda s: jnp.where(s < 6, 3, 2),
    "always_4": lambda s: 4,
}
assert set(SCHEDULE_FNS) == set(M.SCHEDULES)

OUTER_HALF = M.OuterConfig(0.5)
OUTERS = [
    M.OuterConfig(1.0),
    M.OuterConfig(0.7),
    M.OuterConfig(0.7, momentum=0.9, nesterov=True),
    M.OuterConfig(0.7, momentum=0.9, nesterov=True, cooldown=(4, 0.5)),  # issue 29
]


@functools.cache
def outer_tx(cfg: M.OuterConfig, skip_first: bool = True) -> optax.GradientTransformation:
    if cfg.cooldown is not None:  # built for the averager's outer_skip_first (it checks)
        total, fraction = cfg.cooldown
        return lsgd_jax.averaging.diloco_outer(
            total, cfg.lr, cfg.momentum, cooldown=fraction, outer_skip_first=skip_first
        )
    return optax.sgd(cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)


def build_averager(cfg: M.AveragerConfig):
    outer = cfg.outer
    options = dict(
        nonfinite=cfg.nonfinite,
        outer_optimizer=outer_tx(outer, cfg.outer_skip_first) if outer is not None else None,
        outer_skip_first=cfg.outer_skip_first,
        communication_dtype=jnp.bfloat16 if cfg.bf16 else None,
        delta=cfg.delta,
        delay=cfg.delay,
    )
    if cfg.quant is not None:
        q = cfg.quant
        options["communication"] = lsgd_jax.comm.quantized(
            q.bits, block_size=q.block_size, error_feedback=q.error_feedback, two_level=q.two_level
        )
    if cfg.kind == "periodic":
        period = SCHEDULE_FNS[cfg.period] if isinstance(cfg.period, str) else cfg.period
        return lsgd_jax.PeriodicModelAverager(
            period,
            warmup_steps=cfg.warmup,
            process_group=cfg.process_group,
            fragments=cfg.fragments,
            **options,
        )
    return lsgd_jax.HierarchicalModelAverager(dict(cfg.levels), warmup_steps=cfg.warmup, **options)


def build_inner(cfg: M.InnerConfig) -> optax.GradientTransformation:
    if cfg.kind == "sgd":
        tx = optax.sgd(cfg.lr)
    elif cfg.kind in ("momentum", "nesterov"):
        tx = optax.sgd(cfg.lr, momentum=cfg.momentum, nesterov=cfg.kind == "nesterov")
    else:
        tx = optax.adam(cfg.lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    return optax.chain(grad_norm_ema(), tx) if cfg.grad_norm else tx


def arrays_mask(inner_state):
    return jax.tree.map(lambda x: jnp.ndim(x) > 0, inner_state)


def opt_state_mask(kind: str, inner: optax.GradientTransformation, params0):
    if kind == "none":
        return None
    if kind == "arrays":
        return arrays_mask
    return jax.tree.map(lambda _: True, jax.eval_shape(inner.init, params0))


def build_hook(cfg: M.HookConfig) -> optax.GradientTransformation:
    return lsgd_jax.post_local_sgd(
        cfg.start,
        process_group=cfg.process_group,
        subgroup=cfg.subgroup,
        post_local_gradient_allreduce=cfg.post_local_gradient_allreduce,
    )


def build_tx(cfg: M.RunConfig, params0) -> Any:
    """The optax transformation of the "model_averaging", "optimizer" and "step" paths."""
    inner = build_inner(cfg.inner)
    kind = cfg.step_tx if cfg.path == "step" else cfg.path
    parts = [build_hook(cfg.hook)] if cfg.hook is not None else []
    if kind == "model_averaging":
        parts += [inner, lsgd_jax.model_averaging(build_averager(cfg.averager))]
    elif kind == "optimizer":
        mask = opt_state_mask(cfg.opt_state_mask, inner, params0)
        parts += [
            lsgd_jax.post_local_sgd_optimizer(
                inner, build_averager(cfg.averager), average_opt_state=mask
            )
        ]
    else:
        parts += [inner]
    tx = optax.chain(*parts)
    if cfg.multi_steps > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=cfg.multi_steps)
    return tx


# --- reading the library's state back by the model's names --------------------------------

STATE_TYPES = (
    lsgd_jax.PostLocalSGDState,
    lsgd_jax.ModelAveragerState,
    optax.TraceState,
    optax.ScaleByAdamState,
    GradNormState,
    optax.MultiStepsState,
)


STATE_NAMES = {"comm_state": "residual"}  # the model's names of ModelAveragerState fields


def observe(params, opt_state, model_state=None, loss=None) -> dict[str, np.ndarray]:
    """The library's values under the names of ``spec_model._snapshot``."""
    snap = {f"params/{k}": v for k, v in params.items()}

    def floating(tree, prefix):
        for k, v in tree.items():
            if np.issubdtype(np.asarray(v).dtype, np.inexact):
                snap[f"{prefix}/{k}"] = v

    def visit(node):
        for x in jax.tree.leaves(node, is_leaf=lambda x: isinstance(x, STATE_TYPES)):
            if isinstance(x, lsgd_jax.PostLocalSGDState):
                snap["hook/iter"] = x.iter
            elif isinstance(x, lsgd_jax.ModelAveragerState):
                snap["averager/step"] = x.step
                if x.anchor is not None:
                    floating(x.anchor, "averager/anchor")
                if x.outer_count is not None:
                    snap["averager/outer_count"] = x.outer_count
                if x.last_sync is not None:
                    snap["averager/last_sync"] = x.last_sync
                for name in ("comm_state", "inflight_start", "inflight_mean"):
                    if getattr(x, name) is not None:
                        floating(getattr(x, name), f"averager/{STATE_NAMES.get(name, name)}")
                for t in jax.tree.leaves(
                    x.outer_state, is_leaf=lambda t: isinstance(t, optax.TraceState)
                ):
                    if isinstance(t, optax.TraceState):
                        floating(t.trace, "averager/outer_trace")
            elif isinstance(x, optax.TraceState):
                floating(x.trace, "inner/trace")
            elif isinstance(x, optax.ScaleByAdamState):
                snap["inner/count"] = x.count
                floating(x.mu, "inner/mu")
                floating(x.nu, "inner/nu")
            elif isinstance(x, GradNormState):
                snap["inner/gn"] = x.gn
            elif isinstance(x, optax.MultiStepsState):
                snap["multi_steps/mini_step"] = x.mini_step
                snap["multi_steps/gradient_step"] = x.gradient_step
                visit(x.inner_opt_state)

    visit(opt_state)
    if model_state is not None:
        snap.update({f"model_state/{k}": v for k, v in model_state.items()})
    if loss is not None:
        snap["loss"] = loss
    return snap


def tolerance(cfg: M.RunConfig) -> float:
    """float32: a few ulps of the values' scale; bf16 communication: a bf16 ulp or two.

    A quantized mean is float32 too: the model replays the quantizer (deterministic:
    absmax scales, round half to even) operation for operation, so only the order of the
    float32 sums differs; a difference of one grid step (``scale``, about 1% of a
    block's largest value for 8 bits) would be a real difference in the rounding.
    """
    return 2.0**-6 if cfg.averager is not None and cfg.averager.bf16 else 2e-5


def compare(want: dict, got: dict, step: int, rel: float) -> None:
    for name, w in want.items():
        assert name in got, f"step {step}: the library's state has no {name!r}"
        g = np.asarray(got[name])
        assert g.shape == w.shape, f"step {step}: {name} has shape {g.shape}, model {w.shape}"
        if not np.issubdtype(w.dtype, np.inexact):
            np.testing.assert_array_equal(g, w, err_msg=f"step {step}: {name}")
            continue
        finite = np.abs(w[np.isfinite(w)])
        scale = max(1.0, float(finite.max())) if finite.size else 1.0
        np.testing.assert_allclose(
            g, w, rtol=rel, atol=rel * scale, equal_nan=True, err_msg=f"step {step}: {name}"
        )


def check_bitwise_groups(params: dict, groups, step: int) -> None:
    """average_parameters ASSIGNS the mean: the members of a group that averaged are
    bitwise identical at the averaged positions."""
    for members, masks in groups:
        for k, mask in masks.items():
            if not mask.any():
                continue
            vals = np.asarray(params[k])[members][:, mask]
            for i, r in enumerate(members):
                assert np.array_equal(vals[i], vals[0], equal_nan=True), (
                    f"step {step}: params/{k} of replica {r} differs from replica "
                    f"{members[0]} in its group after average_parameters: {vals[i]} vs {vals[0]}"
                )


# --- data ---------------------------------------------------------------------------------


@M.short_repr
@dataclasses.dataclass(frozen=True)
class Injection:
    """A non-finite value in replica r's data at step t: its gradient (via d) or, with
    ``target="model_state"``, its model-state input e."""

    step: int
    replica: int
    leaf: str
    index: int
    value: float
    target: str = "grad"


SHAPES = {"a": (3,), "b": (2, 2)}
QUANTIZED_SHAPES = {"a": (12,), "b": (4, 5)}
"""With a quantized mean, enough values (32) that a group of 8 sends blocks of 2 or 4
integers rather than one float32 all-reduce (which it sends for the 7 of SHAPES)."""


def shapes(cfg: M.RunConfig) -> dict[str, tuple[int, ...]]:
    quantized = cfg.averager is not None and cfg.averager.quant is not None
    return QUANTIZED_SHAPES if quantized else SHAPES


def initial_params(cfg: M.RunConfig, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes(cfg).items()}
    if cfg.int_leaf:
        params["n"] = np.int32(10) * np.ones((), np.int32)
    if cfg.complex_leaf:
        params["z"] = np.array([1 + 1j, -2 + 0.5j], np.complex64)
    return params


def make_batches(cfg: M.RunConfig, steps: int, seed: int, injections) -> list[M.Batch]:
    rng = np.random.default_rng(seed + 1)
    n, out = cfg.topo.size, []
    for t in range(steps):
        c = {k: rng.uniform(0.5, 1.5, (n, *s)).astype(np.float32) for k, s in shapes(cfg).items()}
        d = {k: rng.standard_normal((n, *s)).astype(np.float32) for k, s in shapes(cfg).items()}
        e = rng.standard_normal((n, 2)).astype(np.float32)
        n_inc = rng.integers(0, 5, n).astype(np.int32)
        z_inc = (rng.standard_normal((n, 2)) + 1j * rng.standard_normal((n, 2))).astype(
            np.complex64
        )
        for inj in injections:
            if inj.step == t and inj.target == "grad":
                d[inj.leaf][inj.replica].flat[inj.index % d[inj.leaf][inj.replica].size] = inj.value
            elif inj.step == t:
                e[inj.replica, inj.index % 2] = inj.value
        out.append(M.Batch(c, d, e, n_inc, z_inc))
    return out


def device_batch(cfg: M.RunConfig, batch: M.Batch) -> dict:
    tree = {"c": batch.c, "d": batch.d, "e": batch.e}
    if cfg.int_leaf:
        tree["n_inc"] = batch.n_inc
    if cfg.complex_leaf:
        tree["z_inc"] = batch.z_inc
    return tree


# --- running the library ------------------------------------------------------------------


@functools.lru_cache(maxsize=16)  # each holds compiled programs
def functional_runner(cfg: M.RunConfig):
    """Path (a): post_localSGD_hook -> inner.update -> apply_updates -> average_parameters,
    every value per replica inside one jit(shard_map)."""
    mesh, spec = mesh_of(cfg.topo), P(cfg.topo.names)
    averager, inner = build_averager(cfg.averager), build_inner(cfg.inner)

    def body(params, hook_state, inner_state, avg_state, batch):
        params, hook_state, inner_state, avg_state, batch = squeeze(
            (params, hook_state, inner_state, avg_state, batch)
        )
        train = {k: params[k] for k in M.TRAINABLE}
        grads = {k: batch["c"][k] * (train[k] - batch["d"][k]) for k in M.TRAINABLE}
        grads, hook_state = lsgd_jax.post_localSGD_hook(hook_state, grads)
        updates, inner_state = inner.update(grads, inner_state, train)
        new = dict(params)
        new.update(optax.apply_updates(train, updates))
        if "n" in params:
            new["n"] = params["n"] + batch["n_inc"]
        if "z" in params:
            new["z"] = params["z"] + batch["z_inc"]
        new, avg_state = averager.average_parameters(new, avg_state)
        return unsqueeze((new, hook_state, inner_state, avg_state))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec,) * 4))
    return mesh, averager, inner, f


def run_functional(cfg: M.RunConfig, params0, batches):
    mesh, averager, inner, f = functional_runner(cfg)
    h = cfg.hook
    hook_state = lsgd_jax.PostLocalSGDState(
        h.process_group, h.subgroup, h.start, h.post_local_gradient_allreduce
    )
    train0 = {k: params0[k] for k in M.TRAINABLE}
    state = [lsgd_jax.replicate(x, mesh) for x in (params0, hook_state, inner.init(train0))]
    state.append(lsgd_jax.replicate(averager.init(params0), mesh))
    spec = jax.sharding.NamedSharding(mesh, P(cfg.topo.names))
    out = []
    for batch in batches:
        state = list(f(*state, jax.device_put(device_batch(cfg, batch), spec)))
        params, hook_state, inner_state, avg_state = fetch(state)
        out.append(observe(params, (hook_state, inner_state, avg_state)))
    return out


@functools.lru_cache(maxsize=16)  # each holds compiled programs
def chain_runner(cfg: M.RunConfig, params0_key):
    """Paths (b) and (c): tx.update inside jit(shard_map), then optax.apply_updates."""
    mesh, spec = mesh_of(cfg.topo), P(cfg.topo.names)
    tx = build_tx(cfg, dict(params0_key))

    def body(params, opt_state, batch):
        params, opt_state, batch = squeeze((params, opt_state, batch))
        grads = {k: batch["c"][k] * (params[k] - batch["d"][k]) for k in M.TRAINABLE}
        updates, opt_state = tx.update(grads, opt_state, params)
        return unsqueeze((optax.apply_updates(params, updates), opt_state))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 2))
    return mesh, tx, f


def shapes_key(params0):
    """A hashable stand-in for the params (the mask "all" is built from their state)."""
    return tuple((k, jax.ShapeDtypeStruct(v.shape, v.dtype)) for k, v in sorted(params0.items()))


def run_chain(cfg: M.RunConfig, params0, batches):
    mesh, tx, f = chain_runner(cfg, shapes_key(params0))
    params = lsgd_jax.replicate(params0, mesh)
    opt_state = lsgd_jax.replicate(tx.init(params0), mesh)
    spec = jax.sharding.NamedSharding(mesh, P(cfg.topo.names))
    out = []
    for batch in batches:
        params, opt_state = f(params, opt_state, jax.device_put(device_batch(cfg, batch), spec))
        out.append(observe(*fetch((params, opt_state))))
    return out


def loss_fn(params, batch):
    return sum(
        0.5 * jnp.sum(batch["c"][k][0] * (params[k] - batch["d"][k][0]) ** 2)
        for k in sorted(params)
    )


def loss_with_state(params, model_state, batch):
    new_state = {
        "count": model_state["count"] + 1,
        "stat": 0.5 * model_state["stat"] + batch["e"][0],
    }
    return loss_fn(params, batch), new_state


@functools.lru_cache(maxsize=16)  # each holds compiled programs
def step_runner(cfg: M.RunConfig, params0_key):
    """Path (d): lsgd_jax.data_parallel_step."""
    mesh = mesh_of(cfg.topo)
    tx = build_tx(cfg, dict(params0_key))
    fn = loss_with_state if cfg.model_state else loss_fn
    modes = {"specialize": cfg.specialize, "lowering": cfg.lowering}
    defaults = {"specialize": True, "lowering": "shard_map"}
    modes = {k: v for k, v in modes.items() if v != defaults[k]}
    step = lsgd_jax.data_parallel_step(fn, tx, mesh, with_model_state=cfg.model_state, **modes)
    return mesh, tx, step


def run_step(cfg: M.RunConfig, params0, batches, handoff=None):
    """Path (d). ``handoff=(k, other_cfg, directory)``: before step k the state goes
    through a checkpoint in ``directory`` (saved, restored onto fresh arrays) and the
    run continues with the step object of ``other_cfg`` (another specialize/lowering)."""
    mesh, tx, step = step_runner(cfg, shapes_key(params0))
    params = lsgd_jax.replicate(params0, mesh)
    opt_state = lsgd_jax.replicate(tx.init(params0), mesh)
    model_state = lsgd_jax.replicate(
        {"count": np.zeros((), np.int32), "stat": np.zeros(2, np.float32)}, mesh
    )
    out = []
    for t, batch in enumerate(batches):
        if handoff is not None and t == handoff[0]:
            _, other, directory = handoff
            state = {"p": params, "m": model_state, "s": opt_state}
            lsgd_jax.save_checkpoint(directory, t, state)
            state = lsgd_jax.restore_checkpoint(directory, state, step=t)
            params, model_state, opt_state = state["p"], state["m"], state["s"]
            _, _, step = step_runner(other, shapes_key(params0))
        b = device_batch(cfg, batch)
        if cfg.model_state:
            params, model_state, opt_state, loss = step(params, model_state, opt_state, b)
            out.append(observe(*fetch((params, opt_state, model_state, loss))))
        else:
            params, opt_state, loss = step(params, opt_state, b)
            out.append(observe(*fetch((params, opt_state)), loss=np.array(loss)))
    return out


RUNNERS = {
    "functional": run_functional,
    "model_averaging": run_chain,
    "optimizer": run_chain,
    "step": run_step,
}


def check_run(cfg: M.RunConfig, steps: int, seed: int, injections=()) -> None:
    """Runs the library and the model on the same data; compares after every step."""
    params0 = initial_params(cfg, seed)
    batches = make_batches(cfg, steps, seed, injections)
    if cfg.path == "step" and cfg.hook is None and cfg.averager is not None:
        # Documented as unsupported: a model averager without the hook (the step would
        # be DDP, the replicas never differ). data_parallel_step cannot see the chain
        # before its first call, so that is where it must raise, before anything runs.
        with pytest.raises(ValueError, match="post_local_sgd"):
            run_step(cfg, params0, batches[:1])
        return
    want, groups = M.simulate(cfg, params0, batches)
    got = RUNNERS[cfg.path](cfg, params0, batches)
    for t, (w, g) in enumerate(zip(want, got)):
        compare(w, g, t, tolerance(cfg))
        if cfg.path == "functional":
            params = {k.split("/", 1)[1]: v for k, v in g.items() if k.startswith("params/")}
            check_bitwise_groups(params, groups[t], t)


# --- strategies ---------------------------------------------------------------------------


def rotated(options: list, turn: int) -> list:
    return options[turn % len(options) :] + options[: turn % len(options)]


def axis_subsets(topo: M.Topology) -> list[tuple[str, ...]]:
    """Every nonempty subset of the data axes, in mesh order."""
    names = topo.names
    return [
        tuple(a for i, a in enumerate(names) if mask >> i & 1) for mask in range(1, 2 ** len(names))
    ]


@st.composite
def hooks(draw, topo: M.Topology, start_max: int = 4) -> M.HookConfig:
    return M.HookConfig(
        start=draw(st.integers(0, start_max)),
        post_local_gradient_allreduce=draw(st.booleans()),
        subgroup=draw(st.one_of(st.none(), st.sampled_from(axis_subsets(topo)))),
        process_group=draw(st.sampled_from([None, topo.names])),
    )


@st.composite
def hierarchies(draw, topo: M.Topology):
    """Nested groups (prefixes of a permutation of the axes), the last one global, with
    strictly increasing periods (the last > 1)."""
    order = draw(st.permutations(topo.names))
    sizes = (
        sorted(draw(st.sets(st.integers(1, len(topo.names) - 1), max_size=2)))
        if len(topo.names) > 1
        else []
    )
    groups = [tuple(a for a in topo.names if a in order[:s]) for s in sizes]
    groups.append(draw(st.sampled_from([None, topo.names])))
    periods = sorted(draw(st.sets(st.integers(1, 6), min_size=len(groups), max_size=len(groups))))
    if periods[-1] == 1:
        periods[-1] = 2
    return tuple(zip(periods, groups))


QUANTS = [
    M.QuantConfig(8, 4),
    M.QuantConfig(4, 2, two_level=True),
    M.QuantConfig(8, 64, error_feedback=False, two_level=True),
    M.QuantConfig(4, 4),
    M.QuantConfig(8, 2, two_level=True),
]


@st.composite
def averagers(draw, topo: M.Topology, force: str = "", turn: int = 0) -> M.AveragerConfig:
    """Supported option combinations only (the unsupported ones must raise: see
    test_unsupported_combinations_raise_at_construction). ``force``: "delay" or
    "quant" (or both, "delay+quant") to draw only averagers with those options; ``turn``
    rotates the quantized strategies (what a derandomized draw tries first)."""
    kind = draw(st.sampled_from(["periodic", "hierarchical"]))
    quant = None
    if "quant" in force or draw(st.integers(0, 5)) == 5:  # a strategy of its own
        quant = draw(st.sampled_from(rotated(QUANTS, turn)))
    nonfinite = "propagate" if quant else draw(st.sampled_from(["propagate", "exclude", "skip"]))
    bf16 = draw(st.booleans()) if nonfinite == "propagate" and not quant else False
    outer = draw(st.one_of(st.none(), st.sampled_from(OUTERS)))
    common = dict(
        warmup=draw(st.integers(0, 4)),
        nonfinite=nonfinite,
        outer=outer,
        outer_skip_first=draw(st.booleans()) if outer is not None else True,
        bf16=bf16,
        delta=draw(st.booleans()),
        quant=quant,
    )

    def delay(stride: int) -> int:
        """0 or 1 <= tau < stride ("one average in flight at a time")."""
        if stride < 2:
            return 0
        if "delay" in force:
            return draw(st.integers(1, stride - 1))
        return draw(st.sampled_from([0, 0, 0, *range(1, stride)]))

    if kind == "hierarchical":
        levels = draw(hierarchies(topo))
        return M.AveragerConfig("hierarchical", levels=levels, delay=delay(levels[-1][0]), **common)
    if "delay" in force:
        period = draw(st.integers(2, 4))
    else:
        period = draw(st.one_of(st.integers(2, 4), st.sampled_from(sorted(M.SCHEDULES))))
    fragments = 1
    if isinstance(period, int) and outer is None:
        fragments = draw(
            st.sampled_from(
                [k for k in (1, 2, 3, 4) if period % k == 0 and (period // k > 1 or not force)]
            )
        )
    process_group = draw(st.sampled_from([None, *axis_subsets(topo)]))
    return M.AveragerConfig(
        "periodic",
        period=period,
        process_group=process_group,
        fragments=fragments,
        delay=delay(period // fragments) if isinstance(period, int) else 0,
        **common,
    )


INNERS = [
    M.InnerConfig("sgd"),
    M.InnerConfig("momentum"),
    M.InnerConfig("nesterov"),
    M.InnerConfig("adam", lr=0.05),
    M.InnerConfig("momentum", grad_norm=True),
    M.InnerConfig("adam", lr=0.05, grad_norm=True),
]


@st.composite
def injections(draw, cfg: M.RunConfig, steps: int):
    if cfg.multi_steps > 1:
        return ()  # optax.MultiSteps computes 0 * NaN on the mini-steps it does not emit
    out = []
    for target in ("grad", "model_state") if cfg.model_state else ("grad",):
        if draw(st.booleans()):
            out.append(
                Injection(
                    step=draw(st.integers(0, steps - 1)),
                    replica=draw(st.integers(0, cfg.topo.size - 1)),
                    leaf=draw(st.sampled_from(M.TRAINABLE)),
                    index=draw(st.integers(0, 3)),
                    value=draw(st.sampled_from([np.nan, np.inf, -np.inf])),
                    target=target,
                )
            )
    return tuple(out)


@st.composite
def runs(draw, path: str, force: str = "", turn: int = 0):
    """(config, steps, seed, injections) for one path (``force``, ``turn``: see
    ``averagers``; ``turn`` also rotates the meshes)."""
    topo = draw(st.sampled_from(rotated(TOPOLOGIES, turn)))
    inner = draw(st.sampled_from(INNERS))
    averager = draw(averagers(topo, force, turn))
    # Refused at construction: opt-state averaged with a delay, or sent quantized.
    no_opt_state = averager.delay > 0 or averager.quant is not None
    opt_state_masks = ["none"] if no_opt_state else ["none", "all", "arrays"]
    extra: dict[str, Any] = {}
    hook = draw(hooks(topo))
    if path == "functional":
        extra["int_leaf"] = draw(st.booleans())
        if averager.outer is None and averager.fragments == 1:
            extra["complex_leaf"] = draw(st.booleans())
    if path == "optimizer":
        extra["opt_state_mask"] = draw(st.sampled_from(opt_state_masks))
    if path == "step":
        step_txs = ["model_averaging", "optimizer"] + ([] if force else ["inner"])
        step_tx = draw(st.sampled_from(step_txs))
        extra["step_tx"] = step_tx
        if step_tx == "inner":
            averager = None
            hook = draw(st.sampled_from([None, hook]))  # None: plain DDP
        elif not force:
            hook = draw(st.sampled_from([hook, hook, hook, None]))  # None: must raise
        if step_tx == "optimizer":
            extra["opt_state_mask"] = draw(st.sampled_from(opt_state_masks))
        extra["model_state"] = draw(st.booleans())
        extra["multi_steps"] = draw(st.sampled_from([1, 1, 2, 3]))
        extra["specialize"] = draw(st.sampled_from([True, True, "switch", False]))
        extra["lowering"] = draw(st.sampled_from(["shard_map", "shard_map", "jit"]))
    cfg = M.RunConfig(topo, path, hook, inner, averager, **extra)
    steps = draw(st.integers(6, 10) if force else st.integers(1, 12))
    seed = draw(st.integers(0, 2**16))
    return cfg, steps, seed, draw(injections(cfg, steps))


# --- the properties -----------------------------------------------------------------------


@spec_settings(40)
@given(runs("functional"))
def test_functional_api_matches_the_model(run):
    """(a) post_localSGD_hook -> inner -> apply_updates -> average_parameters."""
    check_run(*run)


@spec_settings(30)
@given(runs("model_averaging"))
def test_model_averaging_chain_matches_the_model(run):
    """(b) optax.chain(post_local_sgd(...), inner, model_averaging(averager))."""
    check_run(*run)


@spec_settings(30)
@given(runs("optimizer"))
def test_post_local_sgd_optimizer_chain_matches_the_model(run):
    """(c) optax.chain(post_local_sgd(...), post_local_sgd_optimizer(inner, averager,
    average_opt_state=...))."""
    check_run(*run)


@spec_settings(50)
@given(runs("step"))
def test_data_parallel_step_matches_the_model(run):
    """(d) data_parallel_step, with and without the hook (DDP), model state, MultiSteps."""
    check_run(*run)


@spec_settings(60)
@given(st.sampled_from(TOPOLOGIES).flatmap(averagers), st.integers(1, 40))
def test_schedule_matches_the_model(cfg, steps):
    """averager.schedule / level against the model's rules (no compile)."""
    averager = build_averager(cfg)
    state = M.averager_init(cfg, {"a": np.zeros((1, 3), np.float32)})
    want = []
    for _ in range(steps):
        level = M.averager_level(cfg, state)
        want.append(level)
        state.step += 1
        if level and isinstance(cfg.period, str):
            state.last_sync = state.step - 1
    assert averager.schedule(steps).tolist() == want
    if not isinstance(cfg.period, str):
        assert [int(averager.level(s)) for s in range(steps)] == want
    assert averager.num_levels == cfg.num_levels
    assert [averager.is_global(k) for k in range(1, cfg.num_levels + 1)] == [
        cfg.is_global(k) for k in range(1, cfg.num_levels + 1)
    ]


UNSUPPORTED = [
    (
        "fragments with an outer optimizer",
        lambda: lsgd_jax.PeriodicModelAverager(4, fragments=2, outer_optimizer=optax.sgd(0.7)),
    ),
    (
        "fragments with a callable period",
        lambda: lsgd_jax.PeriodicModelAverager(SCHEDULE_FNS["always_4"], fragments=2),
    ),
    ("a period not divisible by fragments", lambda: lsgd_jax.PeriodicModelAverager(6, fragments=4)),
    (
        "bf16 with exclude",
        lambda: lsgd_jax.PeriodicModelAverager(
            2, communication_dtype=jnp.bfloat16, nonfinite="exclude"
        ),
    ),
    (
        "bf16 with skip",
        lambda: lsgd_jax.HierarchicalModelAverager(
            {2: "local", 4: None}, communication_dtype=jnp.bfloat16, nonfinite="skip"
        ),
    ),
    ("a zero period", lambda: lsgd_jax.PeriodicModelAverager(0)),
    ("a negative period", lambda: lsgd_jax.PeriodicModelAverager(-2)),
    ("a zero hierarchical period", lambda: lsgd_jax.HierarchicalModelAverager({0: "local"})),
    ("periods out of order", lambda: lsgd_jax.HierarchicalModelAverager({4: "local", 2: None})),
    ("zero fragments", lambda: lsgd_jax.PeriodicModelAverager(4, fragments=0)),
    ("negative warm-up", lambda: lsgd_jax.PeriodicModelAverager(2, warmup_steps=-1)),
    ("an unknown policy", lambda: lsgd_jax.PeriodicModelAverager(2, nonfinite="ignore")),
    ("a negative hook start", lambda: lsgd_jax.post_local_sgd(-1)),
    (
        "an outer optimizer that is not optax",
        lambda: lsgd_jax.PeriodicModelAverager(2, outer_optimizer=0.7),
    ),
]


@pytest.mark.parametrize("make", [m for _, m in UNSUPPORTED], ids=[n for n, _ in UNSUPPORTED])
def test_unsupported_combinations_raise_at_construction(make):
    with pytest.raises((ValueError, TypeError)):
        make()


@spec_settings(30)
@given(
    period=st.integers(2, 12),
    fragments=st.integers(2, 5),
    nonfinite=st.sampled_from(["exclude", "skip"]),
)
def test_unsupported_option_draws_raise(period, fragments, nonfinite):
    """Drawn unsupported combinations raise at construction, never run."""
    with pytest.raises((ValueError, TypeError)):
        lsgd_jax.PeriodicModelAverager(
            max(period * fragments, 2), fragments=fragments, outer_optimizer=optax.sgd(0.7)
        )
    if period % fragments:
        with pytest.raises(ValueError):
            lsgd_jax.PeriodicModelAverager(period, fragments=fragments)
    with pytest.raises(ValueError):
        lsgd_jax.PeriodicModelAverager(
            period + 1, communication_dtype=jnp.bfloat16, nonfinite=nonfinite
        )


# --- directed tests: the behaviour the fixes establish, with exact numbers ----------------

MESH_2X4 = M.Topology(TWO, (2, 4))


def replica_values(*shape, scale=1.0, dtype=np.float32):
    """Replica r holds ``scale * r`` everywhere (PyTorch's test tensors)."""
    r = np.arange(8).reshape((8,) + (1,) * len(shape))
    return (scale * r * np.ones(shape)).astype(dtype)


def average_steps(averager, init_params, per_step_params):
    """Calls ``average_parameters`` once per entry of ``per_step_params`` (per-replica
    trees, leading axis 8) on the 2 x 4 mesh, the state per replica; returns the params
    after each call and the final state, on the host."""
    mesh, spec = mesh_of(MESH_2X4), P(TWO)

    def body(p, s):
        p, s = averager.average_parameters(*squeeze((p, s)))
        return unsqueeze((p, s))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec)))
    state = lsgd_jax.replicate(averager.init(init_params), mesh)
    outs = []
    for params in per_step_params:
        out, state = f(jax.device_put(params, jax.NamedSharding(mesh, spec)), state)
        outs.append(fetch(out))
    return outs, fetch(state)


def average_both(cfg: M.AveragerConfig, init: dict, per_step: list[dict]) -> dict:
    """The same averaging calls through the model and through the library: ``{"model":
    (params after each call, state), "library": (...)}``, model first, so that a
    wrong expectation shows as the model's failure."""
    state = M.averager_init(cfg, {k: np.stack([v] * 8) for k, v in init.items()})
    outs = []
    for params in per_step:
        done, state = M.average_call(cfg, state, params, MESH_2X4)
        outs.append(done.params)
    return {"model": (outs, state), "library": average_steps(build_averager(cfg), init, per_step)}


def test_skipped_global_average_leaves_the_delta_anchor_alone():
    # Hierarchical {1: "local", 4: global}, delta, skip: step 0 is a global average that
    # replica 5's NaN skips; step 1 averages each node, node 0 holding 0, 1, 2, 3 around
    # the untouched anchor 0: 1.5 each (today: the skip moved each anchor to its own
    # params, and node 0 keeps 0, 1, 2, 3).
    cfg = M.AveragerConfig(
        "hierarchical", levels=((1, ("local",)), (4, TWO)), delta=True, nonfinite="skip"
    )
    w = replica_values(1)
    poisoned = w.copy()
    poisoned[5] = np.nan
    init = {"w": np.zeros(1, np.float32)}
    for who, (outs, state) in average_both(cfg, init, [{"w": poisoned}, {"w": w}]).items():
        np.testing.assert_array_equal(outs[1]["w"][:4, 0], [1.5] * 4, err_msg=who)
        np.testing.assert_array_equal(outs[1]["w"][4:, 0], [5.5] * 4, err_msg=who)
        np.testing.assert_array_equal(outs[0]["w"], poisoned, err_msg=who)  # own values
        np.testing.assert_array_equal(state.anchor["w"], np.zeros((8, 1)), err_msg=who)


def test_skipped_global_average_takes_no_outer_step():
    # outer sgd(0.5), no skip-first, anchor 0; replica 7 has a NaN in another leaf, so the
    # global average is skipped: w keeps 0..7 and outer_count stays 0 (today: the outer
    # step still runs, w becomes 0, 0.5, ..., 3.5 and outer_count 1).
    cfg = M.AveragerConfig(
        "periodic", period=2, nonfinite="skip", outer=OUTER_HALF, outer_skip_first=False
    )
    v = np.zeros((8, 1), np.float32)
    v[7] = np.nan
    init = {"v": np.zeros(1, np.float32), "w": np.zeros(1, np.float32)}
    for who, (outs, state) in average_both(cfg, init, [{"v": v, "w": replica_values(1)}]).items():
        np.testing.assert_array_equal(outs[0]["w"][:, 0], np.arange(8), err_msg=who)
        np.testing.assert_array_equal(state.outer_count, np.zeros(8), err_msg=who)
        np.testing.assert_array_equal(state.anchor["w"], np.zeros((8, 1)), err_msg=who)


def test_skipped_first_global_average_does_not_use_up_outer_skip_first():
    # skip-first (default): step 0 is skipped (NaN), so step 2, the first real global
    # average, is still a plain average: 3.5 everywhere, outer_count 1 afterwards
    # (today: 1.75, 2.25, 2.75, ...: an outer step around an anchor the skip moved).
    cfg = M.AveragerConfig("periodic", period=2, nonfinite="skip", outer=OUTER_HALF)
    w = replica_values(1)
    poisoned = w.copy()
    poisoned[7] = np.nan
    init = {"w": np.zeros(1, np.float32)}
    for who, (outs, state) in average_both(
        cfg, init, [{"w": poisoned}, {"w": w}, {"w": w}]
    ).items():
        np.testing.assert_array_equal(outs[2]["w"], np.full((8, 1), 3.5), err_msg=who)
        np.testing.assert_array_equal(state.outer_count, np.ones(8), err_msg=who)


def test_outer_optimizer_leaves_integer_leaves_alone():
    # {"w": f32, "n": int32} with n = 0, 10, ..., 70: the outer sgd(0.7) acts on w only
    # (today: n becomes 0, 7, ..., 49).
    cfg = M.AveragerConfig("periodic", period=2, outer=M.OuterConfig(0.7), outer_skip_first=False)
    init = {"n": np.zeros((), np.int32), "w": np.zeros(1, np.float32)}
    n = np.arange(0, 80, 10, dtype=np.int32)
    for who, (outs, _) in average_both(cfg, init, [{"n": n, "w": replica_values(1)}]).items():
        np.testing.assert_array_equal(outs[0]["n"], n, err_msg=who)
        # w: anchor 0, mean 3.5, pseudo-gradient -3.5, update 0.7 * 3.5
        np.testing.assert_allclose(outs[0]["w"][:, 0], np.full(8, 2.45), rtol=1e-6, err_msg=who)


@pytest.mark.parametrize("skip_first", [True, False])
@pytest.mark.parametrize("delay", [0, 1])
def test_diloco_outer_cools_down_by_its_own_updates(skip_first, delay):
    """Issue 29: averaging.diloco_outer's learning rate and momentum follow the outer
    optimizer's own updates (a plain first average not counted, a delayed average
    counted when it lands), through the averager, against the model's replay."""
    cooldown = M.OuterConfig(0.7, momentum=0.9, nesterov=True, cooldown=(5, 0.4))
    cfg = M.AveragerConfig(
        "periodic", period=2, delay=delay, outer=cooldown, outer_skip_first=skip_first
    )
    rng = np.random.default_rng(7)
    init = {"a": np.zeros(2, np.float32), "w": np.zeros(3, np.float32)}
    per_step = [
        {k: rng.normal(size=(8, *v.shape)).astype(np.float32) * (1 + s) for k, v in init.items()}
        for s in range(14)
    ]
    got = average_both(cfg, init, per_step)
    (want, model_state), (outs, state) = got["model"], got["library"]
    for step, (w, g) in enumerate(zip(want, outs)):
        for k in init:
            np.testing.assert_allclose(g[k], w[k], rtol=2e-6, atol=1e-6, err_msg=f"{step} {k}")
    np.testing.assert_array_equal(state.outer_count, model_state.outer_count)
    # the outer optimizer counted its updates, which the cool-down ran past: a plain average
    hyper = state.outer_state.hyperparams
    assert np.all(np.asarray(state.outer_state.count) >= 5)
    np.testing.assert_allclose(np.asarray(hyper["learning_rate"]), 1.0)
    np.testing.assert_allclose(np.asarray(hyper["momentum"]), 0.0, atol=1e-7)


def test_fragment_average_moves_only_its_part_of_the_delta_anchor():
    # PeriodicModelAverager(2, fragments=2, delta=True), replica r holding r (4 values):
    # step 0 averages values 0-1, step 1 values 2-3, each around the init anchor 0: 3.5
    # everywhere (today: step 0 moves the whole anchor, and values 2-3 stay 0,0,1,1,...,7,7).
    cfg = M.AveragerConfig("periodic", period=2, fragments=2, delta=True)
    w = replica_values(4)
    init = {"w": np.zeros(4, np.float32)}
    for who, (outs, state) in average_both(cfg, init, [{"w": w}, {"w": w}]).items():
        np.testing.assert_array_equal(outs[1]["w"][:, 2:], np.full((8, 2), 3.5), err_msg=who)
        np.testing.assert_array_equal(outs[0]["w"][:, :2], np.full((8, 2), 3.5), err_msg=who)
        np.testing.assert_array_equal(outs[0]["w"][:, 2:], w[:, 2:], err_msg=who)
        np.testing.assert_array_equal(state.anchor["w"], np.full((8, 4), 3.5), err_msg=who)


def test_bf16_communication_averages_the_imaginary_part():
    # complex64 r + 2rj in bf16: the mean is 3.5 + 7j (today: 3.5 + 0j).
    cfg = M.AveragerConfig("periodic", period=2, bf16=True)
    z = (np.arange(8) * (1 + 2j)).astype(np.complex64).reshape(8, 1)
    init = {"z": np.zeros(1, np.complex64)}
    for who, (outs, _) in average_both(cfg, init, [{"z": z}]).items():
        np.testing.assert_array_equal(outs[0]["z"], np.full((8, 1), 3.5 + 7j), err_msg=who)


def test_fragment_average_cuts_adam_moments_like_the_params():
    # post_local_sgd_optimizer(adam, PeriodicModelAverager(2, fragments=2), moments
    # averaged): step 0 averages params values 0-1, and so mu[0:2] and nu[0:2], not all
    # of mu (today: the moments are cut by their own flattened order, mu then nu).
    mesh, spec = mesh_of(MESH_2X4), P(TWO)
    inner = optax.adam(0.1, b1=0.5, b2=0.5)
    tx = lsgd_jax.post_local_sgd_optimizer(
        inner, lsgd_jax.PeriodicModelAverager(2, fragments=2), average_opt_state=arrays_mask
    )

    def body(p, s, g):
        p, s, g = squeeze((p, s, g))
        u, s = tx.update(g, s, p)
        return unsqueeze((optax.apply_updates(p, u), s))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 2))
    p0 = {"w": np.zeros(4, np.float32)}
    grads = {"w": replica_values(4)}
    _, state = f(
        lsgd_jax.replicate(p0, mesh),
        lsgd_jax.replicate(tx.init(p0), mesh),
        jax.device_put(grads, jax.NamedSharding(mesh, spec)),
    )
    adam = fetch(state.inner_state[0])
    r = np.arange(8, dtype=np.float32)[:, None]
    cfg = M.AveragerConfig("periodic", period=2, fragments=2)
    moments = {"mu": {"w": 0.5 * grads["w"]}, "nu": {"w": 0.5 * grads["w"] ** 2}}
    model, _ = M.average_call(
        cfg,
        M.averager_init(cfg, {"w": np.zeros((8, 4), np.float32)}),
        {"w": np.zeros((8, 4), np.float32)},
        MESH_2X4,
        moments,
    )
    for who, mu, nu in [
        ("model", model.extra["mu"]["w"], model.extra["nu"]["w"]),
        ("library", adam.mu["w"], adam.nu["w"]),
    ]:
        np.testing.assert_allclose(mu[:, :2], np.full((8, 2), 1.75), rtol=1e-6, err_msg=who)
        np.testing.assert_allclose(mu[:, 2:], 0.5 * r * np.ones((8, 2)), rtol=1e-6, err_msg=who)
        np.testing.assert_allclose(nu[:, :2], np.full((8, 2), 8.75), rtol=1e-6, err_msg=who)
        np.testing.assert_allclose(nu[:, 2:], 0.5 * r**2 * np.ones((8, 2)), rtol=1e-6, err_msg=who)


def test_multisteps_model_state_is_averaged_only_when_an_update_is_emitted():
    # MultiSteps(k=2) around sgd + model_averaging(Periodic(2)); model state stat += r.
    # Mini-step 0 emits nothing: stat stays 0..7 (today: averaged to 3.5); mini-step 1
    # emits at averager step 0 (an averaging step): stat = mean(2r) = 7.
    mesh = mesh_of(MESH_2X4)
    chain = optax.chain(
        lsgd_jax.post_local_sgd(0, post_local_gradient_allreduce=False),  # no gradient mean
        optax.sgd(0.1),
        lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2)),
    )
    tx = optax.MultiSteps(chain, every_k_schedule=2)

    def loss(params, model_state, batch):
        new_state = {"stat": model_state["stat"] + batch["r"][0]}
        return jnp.sum((params["w"] - batch["x"][0]) ** 2), new_state

    step = lsgd_jax.data_parallel_step(loss, tx, mesh, with_model_state=True)
    p0 = {"w": np.zeros(2, np.float32)}
    params, opt_state = lsgd_jax.replicate(p0, mesh), lsgd_jax.replicate(tx.init(p0), mesh)
    model_state = lsgd_jax.replicate({"stat": np.zeros((), np.float32)}, mesh)
    batch = {"x": np.ones((8, 2), np.float32), "r": np.arange(8, dtype=np.float32)}
    params, model_state, opt_state, _ = step(params, model_state, opt_state, batch)
    np.testing.assert_array_equal(fetch(model_state)["stat"], np.arange(8, dtype=np.float32))
    params, model_state, opt_state, _ = step(params, model_state, opt_state, batch)
    np.testing.assert_array_equal(fetch(model_state)["stat"], np.full(8, 7.0, np.float32))


@pytest.mark.parametrize("shape", [(1, 8), (8, 1)])
def test_data_parallel_step_runs_on_meshes_with_a_size_one_axis(shape):
    # Today: ValueError ("sharded as P('local',), not over the replica axes") on step 2.
    mesh = lsgd_jax.make_mesh(*shape)
    tx = optax.chain(
        lsgd_jax.post_local_sgd(1),
        optax.sgd(0.1, momentum=0.9),
        lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, warmup_steps=1)),
    )
    step = lsgd_jax.data_parallel_step(lambda p, b: jnp.sum((p - b[0]) ** 2), tx, mesh)
    p0 = np.zeros(3, np.float32)
    params, opt_state = lsgd_jax.replicate(p0, mesh), lsgd_jax.replicate(tx.init(p0), mesh)
    batch = np.arange(24, dtype=np.float32).reshape(8, 3)
    for _ in range(4):
        params, opt_state, loss = step(params, opt_state, batch)
    assert np.asarray(params).shape == (8, 3) and np.isfinite(float(loss))
    np.testing.assert_array_equal(np.asarray(opt_state[2].step), np.full(8, 4))


def test_data_parallel_step_without_a_hook_is_ddp():
    # No post_local_sgd in the chain: gradients are averaged over every replica each step,
    # so adamw keeps the replicas identical (today: they drift apart).
    mesh = mesh_of(MESH_2X4)
    tx = optax.adamw(1e-3)
    step = lsgd_jax.data_parallel_step(lambda p, b: jnp.sum((p - b[0]) ** 2), tx, mesh)
    p0 = np.zeros(3, np.float32)
    params, opt_state = lsgd_jax.replicate(p0, mesh), lsgd_jax.replicate(tx.init(p0), mesh)
    rng = np.random.default_rng(0)
    for _ in range(3):
        batch = rng.standard_normal((8, 3)).astype(np.float32)
        params, opt_state, _ = step(params, opt_state, batch)
    p = np.asarray(params)
    for r in range(8):
        np.testing.assert_array_equal(p[r], p[0], err_msg=f"replica {r} drifted from replica 0")


STEP_PATHS = [(True, "shard_map"), ("switch", "shard_map"), (False, "shard_map"), (True, "jit")]


@spec_settings(12)
@given(runs("step"), st.sampled_from(STEP_PATHS), st.integers(0, 11))
def test_a_state_handed_to_another_step_path_matches_the_model(tmp_path_factory, run, to, at):
    """Issue 17: a state made by one step path (compile mode x lowering), saved and
    restored through a checkpoint, and continued by another path, matches the model
    after every step, as an uninterrupted run does."""
    check_handoff(tmp_path_factory, run, to, at)


def check_handoff(tmp_path_factory, run, to: tuple, at: int) -> None:
    """``run`` (path "step"), its state handed at step ``at`` through a checkpoint to the
    step path ``to`` (specialize, lowering), against the model after every step."""
    cfg, steps, seed, injected = run
    if cfg.hook is None and cfg.averager is not None:
        return  # refused before anything runs (see check_run)
    other = dataclasses.replace(cfg, specialize=to[0], lowering=to[1])
    params0 = initial_params(cfg, seed)
    batches = make_batches(cfg, steps, seed, injected)
    want, _ = M.simulate(cfg, params0, batches)
    handoff = (min(at, steps - 1), other, tmp_path_factory.mktemp("handoff"))
    got = run_step(cfg, params0, batches, handoff=handoff)
    for t, (w, g) in enumerate(zip(want, got)):
        compare(w, g, t, tolerance(cfg))


FORCED_PATHS = ["functional", "model_averaging", "optimizer", "step"]


@pytest.mark.parametrize("path", FORCED_PATHS)
@spec_settings(3)
@given(st.data())
def test_delayed_and_quantized_averages_match_the_model(tmp_path_factory, path, data):
    """Issue 17: delayed averages (``delay=``: the average started at t lands at t +
    delay on top of the local progress made meanwhile) and quantized means
    (``comm.quantized``: blockwise integers, two stages, error feedback), each path
    with the other options drawn alongside; the step path also hands its state, with
    an average in flight or a residual, through a checkpoint to another step path."""
    # Derandomized draws start alike for every path: turn the choices per path.
    turn = FORCED_PATHS.index(path)
    force = data.draw(st.sampled_from(rotated(["delay+quant", "quant", "delay"], turn)))
    run = data.draw(runs(path, force, 2 * turn), label="run")
    if path != "step":
        check_run(*run)
        return
    to = data.draw(st.sampled_from(STEP_PATHS), label="to")
    at = data.draw(st.integers(0, run[1] - 1), label="at")
    check_handoff(tmp_path_factory, run, to, at)


# --- quantized means: non-finite values and bytes across nodes (issue 26) -----------------

NONFINITE_QUANTS = [
    M.QuantConfig(bits, 8, error_feedback, two_level)
    for bits in (8, 4)
    for two_level in (False, True)
    for error_feedback in (True, False)
]
NONFINITE_SHAPES = {"a": (200,), "b": (312,)}  # 512 values: 64 blocks of 8 on 2 x 4


def max_blind_to_nan(real_max):
    """A max reduction that skips NaN: issue 26 saw XLA:CPU's return 1.0 for a block that
    held one (the library must test finiteness, not rely on the max)."""

    def blind_max(x, axis=None, **kwargs):
        return real_max(jnp.where(jnp.isnan(x), -jnp.inf, x), axis=axis, **kwargs)

    return blind_max


def nonfinite_program(q: M.QuantConfig):
    """One program on 2 x 4: the averager's mean and the hook's global gradient mean of
    the same per-replica values, with their residuals; and its initial states."""
    mesh, spec = mesh_of(MESH_2X4), P(TWO)
    strategy = lsgd_jax.comm.quantized(
        q.bits, block_size=q.block_size, error_feedback=q.error_feedback, two_level=q.two_level
    )
    averager = lsgd_jax.PeriodicModelAverager(2, communication=strategy)
    hook = lsgd_jax.post_local_sgd(1, communication=strategy)  # step 0: the global mean

    def body(x, avg_state, hook_state):
        x, avg_state, hook_state = squeeze((x, avg_state, hook_state))
        averaged, avg_state = averager.average_parameters(x, avg_state)
        grads, hook_state = hook.update(x, hook_state)
        return unsqueeze((averaged, avg_state.comm_state, grads, hook_state.comm_state))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 4))
    zeros = {k: np.zeros(s, np.float32) for k, s in NONFINITE_SHAPES.items()}
    states = [lsgd_jax.replicate(x.init(zeros), mesh) for x in (averager, hook)]
    return f, jax.NamedSharding(mesh, spec), states


def nonfinite_values(seed: int, blocks: range) -> np.ndarray:
    """(8, 512) float32: block ``b`` of ``blocks`` (of 8 values) holds one NaN, +Inf or
    -Inf at position ``b % 8`` in replica ``3 b % 8``; so 24 blocks hold each kind at
    each position. The other blocks are finite."""
    x = np.random.default_rng(seed).standard_normal((8, 512)).astype(np.float32)
    kinds = (np.nan, np.inf, -np.inf)
    for i, b in enumerate(blocks):
        x[3 * b % 8, 8 * b + b % 8] = kinds[i // 8 % 3]
    return x


@pytest.mark.parametrize("absmax", ["jnp.max", "a max that skips NaN"])
@pytest.mark.parametrize("q", NONFINITE_QUANTS, ids=repr)
def test_a_non_finite_value_anywhere_in_a_block_makes_that_block_of_the_mean_nan(
    monkeypatch, q, absmax
):
    """Issue 26: "A NaN or Inf makes the scale of its block NaN, so that whole block of
    the mean is NaN on every replica ..., wherever in the block it sits"; "the residual
    stays finite". NaN, +Inf and -Inf at every position of a block, one and two levels,
    8 and 4 bits, with and without error feedback, as the averager's mean and as the
    hook's: against the model, and the documented NaN blocks directly. The same with a
    max reduction that skips NaN (what the issue saw on XLA:CPU): a NaN must not be
    counted as 0, the mean come back finite."""
    if absmax != "jnp.max":
        monkeypatch.setattr(jnp, "max", max_blind_to_nan(jnp.max))
    inner = 4 if q.two_level else 1
    layout = M.quant_layout(512, inner, 8 // inner, q.bits, q.block_size)
    assert layout is not None and layout[0] == 8  # quantized, blocks of 8 from value 0
    f, sharding, states = nonfinite_program(q)  # compiled once, on the first call
    names = sorted(NONFINITE_SHAPES)
    cuts = np.cumsum([np.prod(NONFINITE_SHAPES[k]) for k in names])[:-1]
    for seed, blocks in [(0, range(0, 24)), (1, range(40, 64))]:
        x = nonfinite_values(seed, blocks)
        tree = {k: v.reshape(8, *NONFINITE_SHAPES[k]) for k, v in zip(names, np.split(x, cuts, 1))}
        out = fetch(f(jax.device_put(tree, sharding), *states))
        want_mean, want_residual = M.quantized_group_mean(x, q, inner)
        bad = ~np.isfinite(x).reshape(8, 64, 8).all(axis=(0, 2))
        atol = 2e-5 * np.abs(x[np.isfinite(x)]).max()  # float32 sums in another order
        for who, mean, residual in [("averager", out[0], out[1]), ("hook", out[2], out[3])]:
            mean = np.concatenate([mean[k].reshape(8, -1) for k in names], 1).reshape(8, 64, 8)
            assert np.isnan(mean[:, bad]).all(), f"{who}: a non-finite block is not all NaN"
            assert np.isfinite(mean[:, ~bad]).all(), f"{who}: a finite block is not finite"
            np.testing.assert_allclose(
                mean.reshape(8, -1),
                np.broadcast_to(want_mean, (8, 512)),
                rtol=2e-5,
                atol=atol,
                equal_nan=True,
                err_msg=who,
            )
            if q.error_feedback:
                residual = np.concatenate([residual[k].reshape(8, -1) for k in names], 1)
                assert np.isfinite(residual).all(), f"{who}: the residual is not finite"
                np.testing.assert_allclose(residual, want_residual, atol=atol, err_msg=who)


BYTE_MESHES = [(2, 4), (2, 8), (8, 8)]  # (nodes, devices per node)
BYTE_QUANTS = [
    M.QuantConfig(bits, block, two_level=two_level)
    for bits in (8, 4)
    for block in (64, 4)
    for two_level in (False, True)
]
ISSUE_SIZES = (520, 4124, 19477, 37617)  # 520 params; int8's old fallback thresholds
BYTE_SIZES = sorted(
    {*range(1, 4200), *np.geomspace(4200, 100_000, 60).astype(int).tolist(), *ISSUE_SIZES}
)


def test_a_quantized_mean_never_sends_more_across_nodes_than_its_float32_mean():
    """Issue 26: for every tree size from 1 value to 100,000 on 2 x 4, 2 x 8 and 8 x 8
    devices, what a quantized mean sends across nodes (wire bytes, per device) is never
    more than its float32 counterpart's: ``comm.two_level()`` for ``two_level=True``,
    one flat all-reduce for one level. Computed from the plan (the library's, which must
    cut as the model's does); ``test_the_bytes_across_nodes_are_what_compiles`` ties
    these counts to the compiled collectives."""
    from lsgd_jax.comm import _quantize

    for nodes, local in BYTE_MESHES:
        for length in BYTE_SIZES:
            two_level = M.bytes_across("two_level", length, nodes, local)
            flat = M.bytes_across("flat", length, nodes, local)
            for q in BYTE_QUANTS:
                inner = local if q.two_level else 1
                outer = nodes * local // inner
                cut = _quantize.plan(length, inner, outer, q.bits, q.block_size)
                assert cut == M.quant_layout(length, inner, outer, q.bits, q.block_size)
                sent = M.bytes_across(q, length, nodes, local)
                bound = two_level if q.two_level else flat
                assert sent <= bound, (nodes, local, length, q, sent, bound)
                if length in ISSUE_SIZES:  # quantized, not sent in float32
                    assert cut is not None and sent < bound, (nodes, local, length, q)


BYTE_STRATEGIES = [
    "flat",
    "two_level",
    *[
        M.QuantConfig(bits, 64, error_feedback, two_level)
        for bits in (8, 4)
        for two_level in (False, True)
        for error_feedback in (True, False)
    ],
]


def library_strategy(strategy: str | M.QuantConfig) -> lsgd_jax.comm.Communication:
    if strategy == "flat":
        return lsgd_jax.comm.flat()
    if strategy == "two_level":
        return lsgd_jax.comm.two_level()
    q = strategy
    return lsgd_jax.comm.quantized(
        q.bits, block_size=q.block_size, error_feedback=q.error_feedback, two_level=q.two_level
    )


@pytest.mark.parametrize("length", [1, 13, 520, 4124])
def test_the_bytes_across_nodes_are_what_compiles(length):
    """The model's bytes across nodes (``bytes_across``, from the plan) are the wire bytes
    of the compiled average's collectives that span nodes (the ledger's rule), on 2 x 4
    devices, for every strategy of the test above: the fallback's sizes (1), tiny trees
    that quantize (13), the issue's 520 params and int8's old threshold (4,124)."""
    from lsgd_jax.step._ledger import crosses_nodes

    mesh, spec = mesh_of(MESH_2X4), P(TWO)
    sharding = jax.NamedSharding(mesh, spec)
    params = jnp.zeros(length, jnp.float32)

    def abstract(x):
        return jax.ShapeDtypeStruct((8, *jnp.shape(x)), jnp.result_type(x), sharding=sharding)

    for strategy in BYTE_STRATEGIES:
        averager = lsgd_jax.PeriodicModelAverager(2, communication=library_strategy(strategy))

        def body(p, s, averager=averager):
            return unsqueeze(averager.average_parameters(*squeeze((p, s))))

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 2, out_specs=(spec,) * 2))
        args = jax.tree.map(abstract, (params, averager.init(params)))
        report = lsgd_jax.communication_report(f, *args, mesh=mesh)
        across = [c for c in report if crosses_nodes(c, ("local",))]
        assert all(c.scope == "model_averaging" for c in across), strategy
        got = sum(c.wire_bytes for c in across)
        assert got == M.bytes_across(strategy, length, 2, 4), (strategy, str(report))
