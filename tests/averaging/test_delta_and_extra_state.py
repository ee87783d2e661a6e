"""An average's anchor and the state it carries beside the params, against NumPy replays
written from the docstrings (the spec model's ``average_call``) and numbers worked by hand:

6. ``delta=True`` (and an outer optimizer) with replicas that start apart (each
   replica's ``init`` from its own params): the first average of each fragment takes the
   group's common anchor, so the replicas come together as they do without delta.
7. ``nonfinite="skip"``/``"exclude"`` and ``data_parallel_step``'s model state: the model
   state is averaged exactly when, and over the groups where, the params were (and in
   float32 when the params travel quantized).
8. ``average_opt_state`` (and ``average_tree``'s extra values) with a quantized
   communication: refused, with an error that says why; bfloat16 keeps Adam's moments.

The sections are numbered as issue 17's defects 6-8, which these tests pinned down.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import spec_model as M
from helpers import DATA, mesh_2x4, put, rank_values, smap, squeeze, unsqueeze
from jax.sharding import PartitionSpec as P

import lsgd_jax
from lsgd_jax import comm

TOPO = M.Topology(("node", "local"), (2, 4))
GLOBAL = ("node", "local")


def apart(width=4):
    """Replica r starts at params r (PyTorch's test tensors), as NumPy."""
    return {"w": np.asarray(rank_values(8, (width,)))}


def run_library(averager, p0, steps):
    """Each call: params + 1 (``sgd(1.0)`` on a gradient of -1), then
    ``average_parameters``; each replica's state from ``averager.init`` of its own
    params. Returns the params after every call (host) and the last state."""
    mesh = mesh_2x4()

    def body(p, s):
        p, s = squeeze((p, s))
        p = jax.tree.map(lambda x: x + 1.0, p)
        return unsqueeze(averager.average_parameters(p, s))

    f = smap(body, mesh, (DATA, DATA), (DATA, DATA))
    state = put(jax.vmap(averager.init)(p0), mesh, DATA)
    params = put(p0, mesh, DATA)
    out = []
    for _ in range(steps):
        params, state = f(params, state)
        out.append(jax.tree.map(np.array, params))
    return out, jax.tree.map(np.array, state)


def run_model(cfg, p0, steps):
    """The same calls in the NumPy model of the spec (``spec_model.average_call``)."""
    params = {k: v.copy() for k, v in p0.items()}
    state = M.averager_init(cfg, params)
    out = []
    for _ in range(steps):
        params = {k: v + np.float32(1) for k, v in params.items()}
        done, state = M.average_call(cfg, state, params, TOPO)
        params = done.params
        out.append({k: v.copy() for k, v in params.items()})
    return out, state


def assert_runs_agree(got, want):
    for step, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g["w"], w["w"], rtol=1e-6, err_msg=f"step {step}")


def assert_identical(values, rows=slice(None)):
    v = values[rows]
    assert (v == v[0]).all(), f"replicas differ: {v[:, 0]}"


# --- 6. delta with replicas that start apart ---------------------------------------------


def test_delta_brings_replicas_that_start_apart_together():
    # Replica r starts at r, +1 a call; averages at calls 0 and 2. Without delta: 4.5,
    # 5.5, 6.5, 7.5. Before the fix, with delta: r + 1, r + 2, ... (each replica's anchor
    # its own init, so anchor_r + mean(p - anchor_r) keeps the replicas apart).
    p0 = apart()
    plain, _ = run_library(lsgd_jax.PeriodicModelAverager(2), p0, 4)
    got, state = run_library(lsgd_jax.PeriodicModelAverager(2, delta=True), p0, 4)
    want, _ = run_model(M.AveragerConfig("periodic", period=2, delta=True), p0, 4)
    assert_runs_agree(got, want)
    for step in (0, 2):
        assert_identical(got[step]["w"])  # average_parameters: bitwise identical
        np.testing.assert_array_equal(got[step]["w"], plain[step]["w"])
    np.testing.assert_array_equal(got[3]["w"], np.full((8, 4), 7.5))
    np.testing.assert_array_equal(state.anchor["w"], np.full((8, 4), 6.5))


def test_delta_takes_a_common_anchor_at_each_fragments_first_average():
    # fragments=2, period 4: values 0-1 average at calls 0, 4; values 2-3 at call 2. The
    # first average of values 2-3 (call 2) must take a common anchor too: one flag for
    # the whole model, set at call 0, would leave values 2-3 at r + 3.
    p0 = apart()
    averager = lsgd_jax.PeriodicModelAverager(4, fragments=2, delta=True)
    got, state = run_library(averager, p0, 5)
    want, _ = run_model(M.AveragerConfig("periodic", period=4, fragments=2, delta=True), p0, 5)
    assert_runs_agree(got, want)
    np.testing.assert_array_equal(got[0]["w"][:, :2], np.full((8, 2), 4.5))
    np.testing.assert_array_equal(got[2]["w"][:, 2:], np.full((8, 2), 6.5))
    np.testing.assert_array_equal(got[4]["w"], np.full((8, 4), 8.5))
    np.testing.assert_array_equal(state.anchor["w"], np.full((8, 4), [8.5, 8.5, 6.5, 6.5]))


def test_delta_in_a_hierarchy_takes_the_groups_common_anchor_before_the_first_global_one():
    # {2: local, 4: global}, warm-up 1: call 2 averages each node, call 4 globally.
    # Call 2: node 0 holds r + 3 -> 4.5, node 1 -> 8.5 (before the fix: r + 3, apart).
    p0 = apart()
    averager = lsgd_jax.HierarchicalModelAverager({2: "local", 4: GLOBAL}, 1, delta=True)
    got, state = run_library(averager, p0, 5)
    cfg = M.AveragerConfig("hierarchical", levels=((2, ("local",)), (4, GLOBAL)), warmup=1)
    want, _ = run_model(dataclasses.replace(cfg, delta=True), p0, 5)
    assert_runs_agree(got, want)
    np.testing.assert_array_equal(got[2]["w"][:4], np.full((4, 4), 4.5))
    np.testing.assert_array_equal(got[2]["w"][4:], np.full((4, 4), 8.5))
    np.testing.assert_array_equal(got[4]["w"], np.full((8, 4), 8.5))
    np.testing.assert_array_equal(state.anchor["w"], np.full((8, 4), 8.5))


@pytest.mark.parametrize("skip_first", [True, False])
def test_delta_and_an_outer_optimizer_start_from_a_common_anchor(skip_first):
    # outer sgd(0.5) with delta. Skip-first: call 0 plain (4.5); call 2 an outer step
    # from 4.5 to the mean 6.5: 5.5. Without skip-first, call 0 steps from the first
    # replica's init (0) towards 4.5: 2.25, and call 2 from 2.25 towards 4.25: 3.25.
    # Before the fix: anchor_r + 1 = r + 1, and the replicas never meet.
    p0 = apart()
    averager = lsgd_jax.PeriodicModelAverager(
        2, delta=True, outer_optimizer=optax.sgd(0.5), outer_skip_first=skip_first
    )
    got, _ = run_library(averager, p0, 3)
    cfg = M.AveragerConfig(
        "periodic", period=2, delta=True, outer=M.OuterConfig(0.5), outer_skip_first=skip_first
    )
    want, _ = run_model(cfg, p0, 3)
    assert_runs_agree(got, want)
    first, second = (4.5, 5.5) if skip_first else (2.25, 3.25)
    np.testing.assert_array_equal(got[0]["w"], np.full((8, 4), first))
    np.testing.assert_array_equal(got[2]["w"], np.full((8, 4), second))


def test_an_outer_optimizer_without_skip_first_starts_from_a_common_anchor():
    # No delta: the same rule gives the outer step a common origin (the group's first
    # replica's init). Before the fix: r + 0.5 * (4.5 - r), apart.
    p0 = apart()
    averager = lsgd_jax.PeriodicModelAverager(
        2, outer_optimizer=optax.sgd(0.5), outer_skip_first=False
    )
    got, _ = run_library(averager, p0, 3)
    cfg = M.AveragerConfig("periodic", period=2, outer=M.OuterConfig(0.5), outer_skip_first=False)
    want, _ = run_model(cfg, p0, 3)
    assert_runs_agree(got, want)
    np.testing.assert_array_equal(got[0]["w"], np.full((8, 4), 2.25))


def test_delta_with_a_delay_lands_on_a_common_value():
    # delay 1: call 0 starts the average of s = r + 1 (mean 4.5), call 1 lands it on
    # r + 2: r + 2 + (4.5 - (r + 1)) = 5.5 everywhere (before the fix: r + 2).
    p0 = apart()
    averager = lsgd_jax.PeriodicModelAverager(4, delta=True, delay=1)
    got, _ = run_library(averager, p0, 2)
    np.testing.assert_array_equal(got[0]["w"], p0["w"] + 1)  # a delayed average waits
    np.testing.assert_array_equal(got[1]["w"], np.full((8, 4), 5.5))


def test_delta_under_pmap_takes_the_common_anchor_of_index_groups():
    # jax.pmap, one axis: the node level is an IndexGroups of 4 + 4 (no varying-axes
    # types there, so the copy from each group's first replica always runs in its cond).
    groups = lsgd_jax.node_groups("batch", devices_per_node=4)
    averager = lsgd_jax.HierarchicalModelAverager({2: groups, 4: None}, 1, delta=True)
    p0 = apart(3)
    state = jax.vmap(averager.init)(p0)

    def body(p, s):
        return averager.average_parameters(jax.tree.map(lambda x: x + 1.0, p), s)

    f = jax.pmap(body, axis_name="batch")
    params, history = p0, []
    for _ in range(5):
        params, state = f(params, state)
        history.append(np.asarray(params["w"][:, 0]))
    np.testing.assert_array_equal(history[2], [4.5] * 4 + [8.5] * 4)  # node means
    np.testing.assert_array_equal(history[4], [8.5] * 8)  # the global mean


def test_a_skipped_first_average_still_makes_the_anchor_common():
    # skip: replica 5 is NaN at call 0, so the first global average is skipped (the
    # params keep their values) but the anchor becomes the first replica's (0), so the
    # average at call 2 (all finite, r + 3) brings everyone to the mean: 6.5.
    p0 = apart()
    averager = lsgd_jax.PeriodicModelAverager(2, delta=True, nonfinite="skip")
    mesh = mesh_2x4()

    def body(p, s, poison):
        p, s, poison = squeeze((p, s, poison))
        p = jax.tree.map(lambda x: x + 1.0 + poison, p)
        return unsqueeze(averager.average_parameters(p, s))

    f = smap(body, mesh, (DATA, DATA, DATA), (DATA, DATA))
    state = put(jax.vmap(averager.init)(p0), mesh, DATA)
    params = put(p0, mesh, DATA)
    nan = np.zeros((8, 1), np.float32)
    nan[5] = np.nan
    params, state = f(params, state, put(nan, mesh, DATA))
    w = np.array(params["w"])
    np.testing.assert_array_equal(np.delete(w, 5, 0), np.delete(p0["w"] + 1, 5, 0))
    np.testing.assert_array_equal(np.array(state.anchor["w"]), np.zeros((8, 4)))
    healthy = put(np.zeros((8, 1), np.float32), mesh, DATA)
    params = put({"w": p0["w"] + 1}, mesh, DATA)  # replica 5 recovered
    params, state = f(params, state, healthy)
    params, state = f(params, state, healthy)
    np.testing.assert_array_equal(np.array(params["w"]), np.full((8, 4), 6.5))


def test_a_common_init_keeps_the_delta_result_bitwise():
    # The usual case (one init, replicated): the anchor is already common, and the first
    # average sends only the change, exactly as with a state shared by every replica.
    mesh = mesh_2x4()
    p0 = {"w": jax.random.normal(jax.random.key(0), (256,)) * 10.0}
    noise = jax.random.normal(jax.random.key(1), (8, 256)) * 1e-2
    averager = lsgd_jax.PeriodicModelAverager(2, communication_dtype=jnp.bfloat16, delta=True)
    outs = {}
    for name, spec in (("shared", P()), ("per_replica", DATA)):

        def body(p, s, z, spec=spec):
            s = s if spec == P() else squeeze(s)
            p, s = averager.average_parameters({"w": squeeze(p)["w"] + z[0]}, s)
            return unsqueeze(p), (s if spec == P() else unsqueeze(s))

        f = smap(body, mesh, (DATA, spec, DATA), (DATA, spec))
        state = averager.init(p0)
        state = put(state, mesh, P()) if spec == P() else lsgd_jax.replicate(state, mesh)
        out, _ = f(lsgd_jax.replicate(p0, mesh), state, put(noise, mesh, DATA))
        outs[name] = np.array(out["w"])
    np.testing.assert_array_equal(outs["per_replica"], outs["shared"])
    exact = np.asarray(p0["w"]) + np.asarray(noise, np.float64).mean(0)
    assert np.abs(outs["shared"][0] - exact).max() < 1e-4  # the params were not rounded


# --- 7. model state follows the params' non-finite decision --------------------------------


def model_state_step(averager, start=0):
    """data_parallel_step of a toy model: replica r's model state becomes ``batch["r"][r]``,
    its params take the gradient ``batch["x"][r]`` (NaN for a poisoned replica); no
    gradient mean from call ``start`` on, so a NaN stays on its replica. Returns
    ``run(x, r) -> (params, model state)`` on the host, carrying the states along."""
    mesh = mesh_2x4()
    tx = optax.chain(
        lsgd_jax.post_local_sgd(start, post_local_gradient_allreduce=False),
        optax.sgd(1.0),
        lsgd_jax.model_averaging(averager),
    )

    def loss(params, model_state, batch):
        del model_state
        return jnp.sum(params["w"] * batch["x"][0]), {"stat": batch["r"][0]}

    step = lsgd_jax.data_parallel_step(loss, tx, mesh, with_model_state=True)
    p0 = {"w": np.zeros(2, np.float32)}
    carried = [
        lsgd_jax.replicate(p0, mesh),
        lsgd_jax.replicate({"stat": np.zeros((), np.float32)}, mesh),
        lsgd_jax.replicate(tx.init(p0), mesh),
    ]

    def run(x, r):
        carried[:] = step(*carried, {"x": x, "r": r})[:3]
        return np.array(carried[0]["w"]), np.array(carried[1]["stat"])

    return run


RANK = np.arange(8, dtype=np.float32)


def gradients(nan_at=None):
    """A gradient of -r (sgd(1.0) moves replica r's params by +r), NaN on one replica."""
    x = -np.repeat(RANK[:, None], 2, 1)
    if nan_at is not None:
        x[nan_at, 0] = np.nan
    return x


def stats(nan_at=None):
    r = RANK.copy()
    if nan_at is not None:
        r[nan_at] = np.nan
    return r


@pytest.mark.parametrize(
    "averager",
    [
        lsgd_jax.PeriodicModelAverager(2, nonfinite="skip"),
        lsgd_jax.PeriodicModelAverager(2, communication=comm.finite_only("skip")),
    ],
    ids=["nonfinite", "communication"],
)
def test_a_skipped_average_keeps_the_model_state(averager):
    # Replica 3's params are NaN: the global average is skipped, the params keep their
    # values, and so does the model state 0..7 (before the fix: 3.5 everywhere).
    w, stat = model_state_step(averager)(gradients(nan_at=3), stats())
    np.testing.assert_array_equal(np.delete(w[:, 1], 3), np.delete(RANK, 3))
    np.testing.assert_array_equal(stat, RANK)


def test_model_state_skips_in_exactly_the_groups_whose_params_skipped():
    # {1: local, 2: global}, warm-up 1: call 1 averages each node. Node 0 (replica 3 NaN)
    # skips and keeps its model state 0..3; node 1 averages its params and model state:
    # 5.5 (before the fix: node 0's model state became 1.5 too).
    averager = lsgd_jax.HierarchicalModelAverager({1: "local", 2: GLOBAL}, 1, nonfinite="skip")
    run = model_state_step(averager, start=1)
    run(gradients(), stats())  # call 0: the warm-up, nothing averages
    w, stat = run(gradients(nan_at=3), stats())
    # call 0 (gradients still averaged) took everyone to 3.5, call 1 to 3.5 + r
    np.testing.assert_array_equal(w[4:], np.full((4, 2), 9.0))  # averaged over 4..7
    np.testing.assert_array_equal(w[:3, 1], 3.5 + RANK[:3])  # node 0 skipped
    np.testing.assert_array_equal(stat, np.concatenate([RANK[:4], np.full(4, 5.5)]))


@pytest.mark.parametrize("stat_nan", [None, 6])
def test_exclude_averages_the_model_state_where_the_params_averaged(stat_nan):
    # exclude: replica 3's params are NaN, the others' mean heals them. Its model state
    # (3, finite: it came from a forward pass of finite numbers) counts in the model
    # state's mean, 3.5 everywhere; a non-finite model state (replica 6) is left out of
    # it, and healed.
    averager = lsgd_jax.PeriodicModelAverager(2, nonfinite="exclude")
    w, stat = model_state_step(averager)(gradients(nan_at=3), stats(stat_nan))
    assert (w == w[0]).all() and np.isfinite(w).all()
    want = np.delete(RANK, 6).mean() if stat_nan else 3.5
    np.testing.assert_allclose(stat, np.full(8, want, np.float32), rtol=1e-6)


def test_under_skip_a_non_finite_model_state_does_not_cancel_the_average():
    # skip, every params finite (the average happens): replica 6's model state is NaN; it
    # is left out of the model state's mean and healed (before the fix: the model state
    # alone skipped, keeping 0..7 and the NaN, while the params averaged).
    averager = lsgd_jax.PeriodicModelAverager(2, nonfinite="skip")
    w, stat = model_state_step(averager)(gradients(), stats(nan_at=6))
    np.testing.assert_array_equal(w, np.full((8, 2), 3.5, np.float32))
    np.testing.assert_allclose(stat, np.full(8, np.delete(RANK, 6).mean(), np.float32), rtol=1e-6)


# --- 8. optimizer state and quantized communication ------------------------------------------


def every_array(state):
    return jax.tree.map(lambda x: jnp.ndim(x) > 0, state)


@pytest.mark.parametrize("quantized", [comm.quantized(8), comm.quantized(4, error_feedback=False)])
def test_average_opt_state_with_a_quantized_communication_is_refused(quantized):
    averager = lsgd_jax.PeriodicModelAverager(2, communication=quantized)
    with pytest.raises(ValueError, match="average_opt_state.*quantized") as info:
        lsgd_jax.post_local_sgd_optimizer(optax.adam(1e-3), averager, average_opt_state=every_array)
    assert "comm.flat()" in str(info.value) and "second moments" in str(info.value)
    lsgd_jax.post_local_sgd_optimizer(optax.adam(1e-3), averager)  # without: fine


def test_average_tree_extra_values_with_a_quantized_communication_are_refused():
    # The same path without the optimizer: extra values in the quantized buffer, with a
    # zero residual each call (before the fix: accepted, the moments rounded to 0).
    mesh = mesh_2x4()
    averager = lsgd_jax.PeriodicModelAverager(2, communication=comm.quantized(8))
    params = {"w": jnp.zeros(64)}

    def body(p, m, s):
        p, m, s = squeeze((p, m, s))
        return unsqueeze(averager.average_tree(p, m, s))

    f = smap(body, mesh, (DATA,) * 3, (DATA,) * 3)
    args = (params, {"nu": jnp.zeros(64)}, averager.init(params))
    with pytest.raises(ValueError, match="extra.*quantized"):
        f(*(lsgd_jax.replicate(a, mesh) for a in args))


def adam_second_moments(averager):
    """One Adam step with gradient scales 1 to 1e-8, then an average of params and moments:
    the second moments and the largest per-step change of the next update."""
    mesh = mesh_2x4()
    lr = 1e-2
    tx = lsgd_jax.post_local_sgd_optimizer(optax.adam(lr), averager, average_opt_state=every_array)
    scales = np.logspace(0, -8, 64).astype(np.float32)
    grads = scales * (1 + 0.1 * np.arange(8, dtype=np.float32)[:, None])

    def body(p, s, g):
        p, s, g = squeeze((p, s, g))
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
        u2, _ = tx.update(g, s, p)  # the next step's update
        return unsqueeze((p, s, u2))

    f = smap(body, mesh, (DATA, DATA, DATA), (DATA, DATA, DATA))
    p0 = jnp.zeros(64)
    _, state, u2 = f(
        lsgd_jax.replicate(p0, mesh),
        lsgd_jax.replicate(tx.init(p0), mesh),
        put(grads, mesh, DATA),
    )
    return np.array(state.inner_state[0].nu), np.abs(np.array(u2)).max() / lr


def test_bf16_communication_keeps_adams_second_moments():
    # The sound pair: bf16 keeps each value's own exponent, so no second moment is zeroed
    # and the next step moves by about the learning rate, as with the exact mean.
    nu, change = adam_second_moments(
        lsgd_jax.PeriodicModelAverager(2, communication=comm.compressed(jnp.bfloat16))
    )
    exact_nu, exact_change = adam_second_moments(lsgd_jax.PeriodicModelAverager(2))
    assert (nu > 0).all()
    np.testing.assert_allclose(nu, exact_nu, rtol=2e-2)
    assert change < 1.05 * exact_change < 1.1


# --- model state with quantized averages ---------------------------------------------------


@pytest.mark.parametrize("two_level", [False, True])
def test_model_state_travels_in_float32_when_the_params_travel_quantized(two_level):
    """Model state (running variances: entries from 1 down to 1e-8) gets no error
    feedback: in the quantized buffer a block's scale would round its small entries to
    0. It is averaged exactly, in float32, where the params average."""
    averager = lsgd_jax.PeriodicModelAverager(
        2, communication=comm.quantized(8, two_level=two_level, error_feedback=False)
    )
    mesh = mesh_2x4()
    # 1 ... 1e-8, each block of 64 values spanning them (enough values to be quantized)
    scales = np.tile(10.0 ** -np.arange(8, dtype=np.float32), 128)[None, :]
    tree = (1.0 + RANK[:, None]) * scales  # replica r: (r + 1) * scales

    f = smap(
        lambda t, s: unsqueeze(averager.average_alongside(squeeze(t), s)),
        mesh,
        (DATA, P()),
        DATA,
    )
    got = np.array(f(put(tree, mesh, DATA), put(averager.init(), mesh, P())))
    want = tree.mean(0)
    assert (got != 0).all(), got
    np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), rtol=1e-6)


def test_averagers_built_alike_are_equal_however_their_strategy_is_spelled():
    """Issue 17: configuration compared by value; a state from one spelling is accepted
    by the other."""
    P4 = lsgd_jax.PeriodicModelAverager
    pairs = [
        (P4(4), P4(4, communication=comm.flat())),
        (P4(4, nonfinite="skip"), P4(4, communication=comm.finite_only("skip"))),
        (P4(4, communication_dtype=jnp.bfloat16), P4(4, communication=comm.compressed())),
        (P4(4, communication=comm.quantized(4)), P4(4, communication=comm.quantized(4))),
        (
            lsgd_jax.HierarchicalModelAverager({2: "local", 4: GLOBAL}, delta=True),
            lsgd_jax.HierarchicalModelAverager({2: "local", 4: GLOBAL}, delta=True),
        ),
    ]
    for a, b in pairs:
        assert a == b and hash(a) == hash(b), (a, b)
        state = a.init({"w": jnp.zeros(2)})
        assert jax.tree.structure(state) == jax.tree.structure(b.init({"w": jnp.zeros(2)}))
    assert P4(4) != P4(8) and P4(4) != P4(4, delta=True) and P4(4) != P4(4, nonfinite="skip")
    assert P4(4).parts.then == lsgd_jax.PeriodicModelAverager(4, delay=1).parts.then
