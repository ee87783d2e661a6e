"""Every option through every door, against the specification model (issue 33).

The cases (``doors/cases.py``) are the averagers' and the hook's options alone and in
pairs; the doors are the ways a user runs them: ``data_parallel_step`` in each
``specialize`` mode and lowering, ``lsgd_jax.stacked`` under plain ``jax.jit``, a
user's own ``jax.shard_map`` step (docs/training_loops.md), the elastic loop's step,
and a checkpoint round trip in the middle of a run. Each door's params (and model
state) after every step are compared with the model's replay of the case within the
tolerances of tests/spec/test_spec.py, and with the first door's (data_parallel_step's
defaults); the checkpoint round trip must be bitwise the uninterrupted run. Pairs that
the constructors refuse on purpose are asserted to be refused with a message naming
the conflict.

The elastic loop runs as several processes (``ElasticLoop`` refuses to be built
without ``jax.distributed``); here its step is driven in one process from the pieces
the loop is made of: its argument checks (which build the step once on one device),
its fresh state, and each step its attempt work (``_loop._TrainWork``: the batch
assembled from the process's rows, the step the loop builds for a membership), on a
membership of one process over the case's mesh.

Tiers: the fast tier runs ``FAST`` (a fixed sample: the base case through every door,
a few options and pairs through one or two). The slow tier runs every pair through one
door, chosen so that every option goes through every door among the pairs
(``cases.assign_doors``), and every option alone through one door, on 2 x 4 and on
4 x 2 replicas; README's test command runs a fixed sample of it (every option alone on
2 x 4, every 8th pair), ``LSGD_JAX_DOORS=all`` all of it.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lsgd_jax
from doors import cases as C
from lsgd_jax.elastic import Layout, _loop, _start

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*inside the subgroup over which post_local_sgd"),
    pytest.mark.filterwarnings("ignore:XLA's CPU client runs this process's"),
]

DATA = P(C.AXES)
DOORS = (
    "phase-shard_map",
    "switch-shard_map",
    "cond-shard_map",
    "phase-jit",
    "switch-jit",
    "cond-jit",
    "stacked",
    "user_shard_map",
    "elastic",
    "checkpoint",
)
REFERENCE = DOORS[0]  # data_parallel_step's defaults: the door the others are held to


@pytest.fixture(autouse=True)
def quiet_library_logger():
    """No warning callbacks compiled in (the non-finite policies log), nothing printed."""
    logger = logging.getLogger("lsgd_jax")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


# --- the library objects of a case -----------------------------------------------------------


def communication(name: str | None) -> Any:
    if name is None:
        return None
    if name in C.QUANTS:
        q = C.QUANTS[name]
        return lsgd_jax.comm.quantized(
            q.bits, block_size=q.block_size, error_feedback=q.error_feedback, two_level=q.two_level
        )
    return {
        "flat": lsgd_jax.comm.flat,
        "finite_only": lambda: lsgd_jax.comm.finite_only("exclude"),
        "compressed": lambda: lsgd_jax.comm.compressed(jnp.bfloat16),
        "two_level": lsgd_jax.comm.two_level,
    }[name]()


def adaptive_period(step):
    return jnp.where(step < 6, 3, 2)  # spec_model.SCHEDULES["3_then_2"]


def build_averager(case: C.Case):
    options: dict[str, Any] = dict(
        warmup_steps=case.warmup,
        nonfinite=case.nonfinite,
        delta=case.delta,
        delay=case.delay,
        offload_state=case.offload or None,
        communication=communication(case.comm),
        communication_dtype=jnp.bfloat16 if case.comm_dtype else None,
    )
    if case.outer is not None:
        options["outer_optimizer"] = optax.sgd(
            C.OUTER.lr, momentum=C.OUTER.momentum, nesterov=C.OUTER.nesterov
        )
        options["outer_skip_first"] = case.outer == "skip_first"
    if case.schedule == "hierarchical":
        levels = {p: g for p, g in C.HIERARCHY}
        if case.group == "node":
            levels = {p: g or C.AXES for p, g in C.HIERARCHY}
            options["process_group"] = C.AXES
        return lsgd_jax.HierarchicalModelAverager(levels, **options)
    period = adaptive_period if case.schedule == "adaptive" else case.period
    if case.group:
        options["process_group"] = (case.group,)
    return lsgd_jax.PeriodicModelAverager(period, fragments=case.fragments, **options)


def build_tx(case: C.Case) -> optax.GradientTransformation:
    hook = lsgd_jax.post_local_sgd(
        case.hook_start,
        post_local_gradient_allreduce=case.hook_allreduce,
        communication=communication(case.hook_comm),
    )
    return optax.chain(
        hook,
        optax.sgd(C.LR, momentum=C.MOMENTUM),
        lsgd_jax.model_averaging(build_averager(case)),
    )


def loss_fn(params, batch):
    """One replica's ``0.5 * sum(c * (w - d)**2)`` over the leaves, in float32."""
    return sum(
        0.5 * jnp.sum(batch["c"][k][0] * (params[k].astype(jnp.float32) - batch["d"][k][0]) ** 2)
        for k in sorted(params)
    )


def loss_with_state(params, model_state, batch):
    new_state = {
        "count": model_state["count"] + 1,
        "stat": 0.5 * model_state["stat"] + batch["e"][0],
    }
    return loss_fn(params, batch), new_state


@functools.cache
def mesh_of(shape: tuple[int, int]):
    return lsgd_jax.make_mesh(*shape)


def device_batch(batch) -> dict:
    return {"c": batch.c, "d": batch.d, "e": batch.e}


def host(tree):
    """Host copies (a step donates its inputs)."""
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


# --- the doors ----------------------------------------------------------------------------------
# Each returns one ``(params, model_state or None)`` of host arrays per step.


def fresh_state(case: C.Case, tx, mesh):
    params0 = C.initial_params()
    params = lsgd_jax.replicate(params0, mesh)
    opt_state = lsgd_jax.replicate(tx.init(params0), mesh)
    model_state = lsgd_jax.replicate(C.initial_model_state(), mesh)
    return params, model_state, opt_state


# XLA options of every program a door compiles (the slow tier: cheaper compiles, about
# half the CPU time; what is checked is how the options compose, not XLA's optimizer).
XLA: dict = {}
CHEAP_XLA = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def make_step(case: C.Case, tx, mesh, specialize="phase", lowering="shard_map"):
    fn = loss_with_state if case.model_state else loss_fn
    return lsgd_jax.data_parallel_step(
        fn,
        tx,
        mesh,
        with_model_state=case.model_state,
        specialize=specialize,
        lowering=lowering,
        compiler_options=XLA or None,
    )


def call_step(case, step, state, batch):
    params, model_state, opt_state = state
    if case.model_state:
        params, model_state, opt_state, _ = step(params, model_state, opt_state, batch)
    else:
        params, opt_state, _ = step(params, opt_state, batch)
    return params, model_state, opt_state


def snapshot(case, params, model_state):
    return host(params), host(model_state) if case.model_state else None


def run_data_parallel_step(case: C.Case, data, specialize: str, lowering: str):
    mesh, tx = mesh_of(case.shape), build_tx(case)
    step = make_step(case, tx, mesh, specialize, lowering)
    state, out = fresh_state(case, tx, mesh), []
    for batch in data:
        state = call_step(case, step, state, device_batch(batch))
        out.append(snapshot(case, state[0], state[1]))
    return out


def run_checkpoint(case: C.Case, data, directory):
    """data_parallel_step's defaults; before step ``at`` the state goes through
    save_checkpoint and restore_checkpoint (onto fresh arrays), and a new step object,
    as a restarted job builds, continues."""
    mesh, tx = mesh_of(case.shape), build_tx(case)
    at = case.first_global_step + 1  # a delayed average in flight
    step = make_step(case, tx, mesh)
    state, out = fresh_state(case, tx, mesh), []
    for t, batch in enumerate(data):
        if t == at:
            names = ("params", "model_state", "opt_state")
            lsgd_jax.save_checkpoint(directory, t, dict(zip(names, state)))
            target = dict(zip(names, fresh_state(case, tx, mesh)))
            restored = lsgd_jax.restore_checkpoint(directory, target, step=t)
            state = tuple(restored[k] for k in names)
            step = make_step(case, tx, mesh)
        state = call_step(case, step, state, device_batch(batch))
        out.append(snapshot(case, state[0], state[1]))
    return out


def run_stacked(case: C.Case, data):
    """lsgd_jax.stacked under plain jax.jit, as docs/training_loops.md writes it."""
    mesh = mesh_of(case.shape)
    stx = lsgd_jax.stacked(build_tx(case), mesh)

    @functools.partial(jax.jit, compiler_options=XLA or None)
    def jit_step(params, opt_state, batch):
        rows = jax.tree.map(lambda x: x.reshape(mesh.size, -1, *x.shape[1:]), batch)
        _, grads = jax.vmap(jax.value_and_grad(loss_fn))(params, rows)
        updates, opt_state = stx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = lsgd_jax.replicate(C.initial_params(), mesh)
    opt_state, out = stx.init(params), []
    for batch in data:
        params, opt_state = jit_step(params, opt_state, device_batch(batch))
        out.append((host(params), None))
    return out


def run_user_shard_map(case: C.Case, data):
    """A user's own jit(shard_map) step, as docs/training_loops.md writes it."""
    mesh, tx = mesh_of(case.shape), build_tx(case)

    def body(params, opt_state, batch):
        params, opt_state = jax.tree.map(lambda x: x[0], (params, opt_state))
        grads = jax.grad(loss_fn)(params, batch)  # this replica's rows
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return jax.tree.map(lambda x: x[None], (params, opt_state))

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(DATA,) * 3, out_specs=(DATA,) * 2)
    train = jax.jit(mapped, compiler_options=XLA or None)
    params, _, opt_state = fresh_state(case, tx, mesh)
    out = []
    for batch in data:
        batch = jax.device_put(device_batch(batch), NamedSharding(mesh, DATA))
        params, opt_state = train(params, opt_state, batch)
        out.append((host(params), None))
    return out


def run_elastic(case: C.Case, data):
    """The elastic loop's step in one process. ``ElasticLoop`` itself needs
    ``jax.distributed`` (its constructor refuses without it), so this runs the pieces it
    is built from: its argument checks (which build the step once on one device), its
    fresh state, and each step its attempt work (``_TrainWork``: the batch assembled from
    this process's rows, the step the loop builds for a membership), on a membership of
    one process over the case's mesh."""
    mesh, tx = mesh_of(case.shape), build_tx(case)
    fn = loss_with_state if case.model_state else loss_fn
    options = {"with_model_state": True} if case.model_state else {}
    if XLA:
        options["compiler_options"] = XLA
    model_state0 = C.initial_model_state() if case.model_state else None
    _start._check_loop_args(fn, tx, options, None, 20, model_state0)
    work = _loop._TrainWork(
        fn,
        tx,
        options,
        lambda step, layout: device_batch(data[step]),  # the one process's rows: all
        None,
        None,
        (),
    )
    layout = Layout(processes=(0,), row=0, devices_per_process=mesh.size, epoch=0, mesh=mesh)
    state = _start._fresh_state(mesh, C.initial_params(), tx, model_state0)
    out = []
    for t in range(len(data)):
        state, _, _ = work(state, t, layout)
        out.append(snapshot(case, state[0], state[1] if case.model_state else None))
    return out


def run_door(case: C.Case, door: str, data):
    if door == "stacked":
        return run_stacked(case, data)
    if door == "user_shard_map":
        return run_user_shard_map(case, data)
    if door == "elastic":
        return run_elastic(case, data)
    if door == "checkpoint":
        with tempfile.TemporaryDirectory(prefix="lsgd_doors_") as directory:
            return run_checkpoint(case, data, directory)
    specialize, lowering = door.split("-")
    return run_data_parallel_step(case, data, specialize, lowering)


# --- running and comparing ---------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def model_run(case: C.Case):
    return C.replay(case, C.initial_params(), C.batches(case))


_RUNS: dict[C.Case, list] = {}  # this worker's runs of REFERENCE, for door-to-door checks


def door_run(case: C.Case, door: str):
    if door != REFERENCE:
        return run_door(case, door, C.batches(case))
    if case not in _RUNS:
        _RUNS[case] = run_door(case, door, C.batches(case))
    return _RUNS[case]


def as_f64(x):
    return np.asarray(x).astype(np.float64)


def compare(case: C.Case, want, got, what: str) -> None:
    """``got`` (params, model state per step) against ``want`` within the case's
    tolerance per leaf (relative to the leaf's largest finite value, at least 1)."""
    for t, (w_trees, g_trees) in enumerate(zip(want, got)):
        for name, w_tree, g_tree in zip(("params", "model_state"), w_trees, g_trees):
            for k, w in (w_tree or {}).items():
                g, where = g_tree[k], f"{what}: step {t} {name}/{k} ({w.dtype})"
                assert g.shape == w.shape, f"{where}: shape {g.shape}, not {w.shape}"
                rel = C.tolerance(case, w.dtype)
                w64, g64 = as_f64(w), as_f64(g)
                finite = np.abs(w64[np.isfinite(w64)])
                scale = max(1.0, float(finite.max())) if finite.size else 1.0
                np.testing.assert_allclose(
                    g64,
                    w64,
                    rtol=rel,
                    atol=rel * scale,
                    equal_nan=True,
                    err_msg=f"{where}, tolerance {rel:g} x {scale:.3g}",
                )


def compare_bitwise(want, got, what: str) -> None:
    for t, (w_trees, g_trees) in enumerate(zip(want, got)):
        for name, w_tree, g_tree in zip(("params", "model_state"), w_trees, g_trees):
            for k, w in (w_tree or {}).items():
                g = g_tree[k]
                assert np.array_equal(w, g, equal_nan=True), (
                    f"{what}: step {t} {name}/{k} differs by up to "
                    f"{np.nanmax(np.abs(as_f64(w) - as_f64(g))):.3g}"
                )


def model_snapshots(case: C.Case):
    return [(s.params, s.model_state) for s in model_run(case)]


def check_door(case: C.Case, door: str) -> None:
    got = door_run(case, door)
    assert len(got) == C.STEPS
    compare(case, model_snapshots(case), got, f"{door} against the model")
    if door == "checkpoint":
        reference = door_run(case, REFERENCE)
        compare_bitwise(reference, got, "checkpoint against the uninterrupted run")
    elif door != REFERENCE and case in _RUNS:
        compare(case, _RUNS[case], got, f"{door} against {REFERENCE}")


def check_refused(case: C.Case) -> None:
    kind, words = C.refusal(case)
    with pytest.raises(kind) as info:
        build_tx(case)
    message = str(info.value)
    missing = [w for w in words if w not in message]
    assert not missing, f"the refusal of {case.id} does not name {missing}: {message}"


# --- the tiers ----------------------------------------------------------------------------


def door_items(cases_and_doors, marks=()):
    return [
        pytest.param(
            case, door, id=f"{case.id}-{door}", marks=[pytest.mark.xdist_group(case.id), *marks]
        )
        for case, door in cases_and_doors
        if C.runs(case, door)
    ]


FAST_CASES = [
    C.case_of(),
    C.case_of("frag4"),
    C.case_of("delay", "outer"),
    C.case_of("comm_q8", "hook_q8_two_level"),
    C.case_of("model_state", "skip"),
    C.case_of("hierarchical", "delta", shape=(4, 2)),
    C.case_of("outer", "offload"),
]
FAST = [(FAST_CASES[0], door) for door in DOORS] + [
    (FAST_CASES[1], "phase-shard_map"),
    (FAST_CASES[1], "checkpoint"),
    (FAST_CASES[2], "phase-shard_map"),
    (FAST_CASES[2], "checkpoint"),
    (FAST_CASES[3], "switch-jit"),
    (FAST_CASES[3], "stacked"),
    (FAST_CASES[4], "cond-shard_map"),
    (FAST_CASES[4], "elastic"),
    (FAST_CASES[5], "user_shard_map"),
    (FAST_CASES[5], "phase-jit"),
    (FAST_CASES[6], "stacked"),
]


def all_slow_items():
    """Every pair through one door, every option alone through one door, on 2 x 4 and on
    4 x 2 replicas (``assign_doors``: every option meets every door among the pairs)."""
    chosen = C.assign_doors(C.pairs(), DOORS, C.runs)
    chosen += C.assign_doors(C.singles(), DOORS, C.runs)
    chosen += C.assign_doors([C.case_of(o.name, shape=(4, 2)) for o in C.OPTIONS], DOORS, C.runs)
    return chosen


# The whole matrix takes about 16 CPU-minutes; README's test command (and so CI) runs a
# fixed sample of it, and ``LSGD_JAX_DOORS=all`` runs all of it (before a release, or
# after a change to a door or to how options compose).
EVERY_PAIR = os.environ.get("LSGD_JAX_DOORS", "") == "all"
SAMPLE_EVERY = 8  # the sample: every option alone on 2 x 4, and every 8th pair


def slow_items():
    """:func:`all_slow_items` less those the fast tier runs; unless ``LSGD_JAX_DOORS=all``,
    only every option alone on 2 x 4 and every :data:`SAMPLE_EVERY`-th pair."""
    fast = set(FAST)
    chosen = all_slow_items()
    if not EVERY_PAIR:
        n_pairs = len(C.assign_doors(C.pairs(), DOORS, C.runs))
        n_singles = len(C.assign_doors(C.singles(), DOORS, C.runs))
        pairs, singles = chosen[:n_pairs], chosen[n_pairs : n_pairs + n_singles]
        chosen = pairs[::SAMPLE_EVERY] + singles
    return [cd for cd in chosen if cd not in fast]


@pytest.mark.parametrize("case,door", door_items(FAST))
def test_a_door_matches_the_model(case, door):
    check_door(case, door)


@pytest.mark.parametrize("case,door", door_items(slow_items(), marks=[pytest.mark.slow]))
def test_every_option_through_every_door(case, door, monkeypatch):
    monkeypatch.setitem(globals(), "XLA", CHEAP_XLA)
    check_door(case, door)


REFUSED = [c for c in C.singles() + C.pairs() if C.refusal(c) is not None]


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c.id)
def test_a_refused_pair_names_its_conflict(case):
    check_refused(case)


def test_the_matrix_counts():
    """Every option alone and every pair across axes is run, refused or not applicable,
    and every option meets every door it can among the pairs; the counts are what the
    generator makes (a change to OPTIONS shows here)."""
    singles, pairs = C.singles(), C.pairs()
    refused = [c for c in singles + pairs if C.refusal(c)]
    na = [c for c in singles + pairs if C.refusal(c) is None and C.not_applicable(c)]
    assert (len(C.OPTIONS), len(pairs), len(refused), len(na)) == (31, 415, 28, 4)
    met = {(o, door) for case, door in C.assign_doors(pairs, DOORS, C.runs) for o in case.options}
    can = {(o.name, d) for o in C.OPTIONS for d in DOORS if C.runs(C.case_of(o.name), d)}
    assert can - met == set()
    # pairs, and singles on 2 x 4 and 4 x 2, less what the fast tier runs already
    fast_too = len(set(FAST) & set(all_slow_items()))
    assert len(all_slow_items()) == 383 + 31 + 31
    if EVERY_PAIR:
        assert len(slow_items()) + fast_too == 383 + 31 + 31
