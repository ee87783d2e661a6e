"""Bad numbers and odd inputs: NaN/Inf policies, bf16 means, donation, schedules."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    DATA,
    mesh_2x4,
    put,
    smap,
    squeeze,
    torch_hierarchical_level,
    torch_periodic_level,
    unsqueeze,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import lsgd_jax

# the slow tier: 24 s on 2 workers (2026-12-01)
pytestmark = pytest.mark.slow


def average_once(averager, values):
    mesh = mesh_2x4()

    def body(p, s):
        p, s = averager.average_parameters(squeeze(p), s)
        return unsqueeze(p), s

    f = smap(body, mesh, (DATA, P()), (DATA, P()))
    out, _ = f(put(values, mesh, DATA), put(averager.init(), mesh, P()))
    jax.effects_barrier()
    return jax.tree.map(np.asarray, out)


def poisoned():
    rng = np.random.default_rng(0)
    tree = {"w": rng.standard_normal((8, 50)).astype(np.float32), "b": np.ones((8, 3), np.float32)}
    tree["w"][3, 7] = np.nan
    tree["b"][6, 0] = np.inf
    return tree


def test_propagate_is_pytorch_behaviour_nan_spreads():
    out = average_once(lsgd_jax.PeriodicModelAverager(2), poisoned())
    assert np.isnan(out["w"][:, 7]).all()  # every replica's element 7 is now NaN
    assert np.isinf(out["b"][:, 0]).all()
    assert np.isfinite(out["w"][:, :7]).all()  # the mean is elementwise, as in PyTorch


def test_exclude_averages_the_finite_replicas_and_heals_the_others(caplog):
    caplog.set_level(logging.WARNING, logger="lsgd_jax")
    tree = poisoned()
    out = average_once(lsgd_jax.PeriodicModelAverager(2, nonfinite="exclude"), tree)
    finite = [r for r in range(8) if r not in (3, 6)]
    for name in tree:
        want = tree[name][finite].astype(np.float64).mean(0)
        for r in range(8):  # every replica, the two bad ones included, gets the same mean
            np.testing.assert_array_equal(out[name][r], out[name][0])
        np.testing.assert_allclose(out[name][0], want, rtol=1e-6, atol=1e-7)
    msgs = sorted(r.getMessage() for r in caplog.records)
    assert len(msgs) == 2 and "replica 3" in msgs[0] and "replica 6" in msgs[1]
    assert "2 of its group non-finite" in msgs[0]


def test_skip_leaves_only_the_affected_groups_unaveraged(caplog):
    caplog.set_level(logging.WARNING, logger="lsgd_jax")
    tree = poisoned()
    tree["b"][6, 0] = 1.0  # only replica 3 (node 0) is bad
    averager = lsgd_jax.HierarchicalModelAverager({1: "local", 2: None}, nonfinite="skip")
    mesh = mesh_2x4()

    def body(p, s):
        p, s = averager.average_parameters(squeeze(p), s)
        return unsqueeze(p), s

    f = smap(body, mesh, (DATA, P()), (DATA, P()))
    state = put(averager.init().replace(step=jnp.int32(1)), mesh, P())  # step 1: "local"
    out, _ = f(put(tree, mesh, DATA), state)
    out = jax.tree.map(np.asarray, out)
    np.testing.assert_array_equal(out["w"][:4], tree["w"][:4])  # node 0 skipped
    np.testing.assert_allclose(
        out["w"][4:], np.broadcast_to(tree["w"][4:].mean(0), (4, 50)), rtol=1e-6
    )
    jax.effects_barrier()
    assert any(
        "replica 3" in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records
    )


def test_exclude_through_model_averaging():
    mesh = mesh_2x4()
    tx = lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, nonfinite="exclude"))

    def body(u, p, s):
        u, s = tx.update(squeeze(u), s, squeeze(p))
        return unsqueeze(optax.apply_updates(squeeze(p), u)), s

    f = smap(body, mesh, (DATA, DATA, P()), (DATA, P()))
    params = np.random.default_rng(1).standard_normal((8, 20)).astype(np.float32)
    healthy = [r for r in range(8) if r != 5]
    want = np.broadcast_to(params[healthy].mean(0), (8, 20))
    state = put(tx.init(None), mesh, P())

    # A NaN in this step's update: the replica is left out, and healed.
    updates = np.zeros_like(params)
    updates[5, 2] = np.nan
    out, _ = f(put(updates, mesh, DATA), put(params, mesh, DATA), state)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)

    # NaN params already: the others are protected, but apply_updates adds to a NaN.
    bad = params.copy()
    bad[5, 2] = np.nan
    out, _ = f(put(np.zeros_like(params), mesh, DATA), put(bad, mesh, DATA), state)
    out = np.asarray(out)
    np.testing.assert_allclose(out[healthy], want[healthy], rtol=1e-5, atol=1e-6)
    assert np.isnan(out[5, 2])  # the NaN element stays NaN; the rest of it is healed
    np.testing.assert_allclose(np.delete(out[5], 2), np.delete(want[5], 2), rtol=1e-5, atol=1e-6)


def test_bad_policy_is_rejected():
    with pytest.raises(ValueError, match="nonfinite must be one of .* got 'drop'"):
        lsgd_jax.PeriodicModelAverager(2, nonfinite="drop")


@pytest.mark.parametrize("nonfinite", ["propagate", "exclude"])
def test_bf16_means_are_accumulated_in_f32(nonfinite):
    rng = np.random.default_rng(2)
    # Values of mixed magnitude: summing 8 of them in bf16 loses low-order bits.
    vals = (rng.standard_normal((8, 4096)) * np.exp2(rng.integers(-6, 6, (8, 1)))).astype(
        np.float32
    )
    params = jnp.asarray(vals, jnp.bfloat16)
    out = average_once(lsgd_jax.PeriodicModelAverager(2, nonfinite=nonfinite), {"p": params})["p"]
    exact = np.asarray(params, np.float64).mean(0)
    want = np.asarray(jnp.asarray(exact, jnp.float32).astype(jnp.bfloat16))  # one rounding
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), np.asarray(want, np.float32))
    # The same mean taken in bf16 by the collective itself is measurably worse.
    mesh = mesh_2x4()
    naive = smap(lambda p: jax.lax.pmean(p, ("node", "local")), mesh, DATA, DATA)(
        put(params, mesh, DATA)
    )
    err_naive = np.abs(np.asarray(naive[0], np.float64) - exact).max()
    err_ours = np.abs(np.asarray(out[0], np.float64) - exact).max()
    assert err_ours <= err_naive


def test_step_donates_its_state():
    mesh = mesh_2x4()
    tx = optax.chain(lsgd_jax.post_local_sgd(1), optax.sgd(0.1))
    step = lsgd_jax.data_parallel_step(lambda p, b: jnp.mean((b @ p) ** 2), tx, mesh)
    params = lsgd_jax.replicate(jnp.ones(3), mesh)
    opt_state = lsgd_jax.replicate(tx.init(jnp.ones(3)), mesh)
    new_params, new_state, _ = step(params, opt_state, jnp.ones((8, 3)))
    assert params.is_deleted()  # donated: no second copy of the params is kept
    assert all(x.is_deleted() for x in jax.tree.leaves(opt_state))
    step(new_params, new_state, jnp.ones((8, 3)))  # the outputs feed the next step


# --- the schedules, against a plain-Python model of PyTorch's rules --------------------


@settings(max_examples=60, deadline=None)
@given(period=st.integers(1, 64), warmup=st.integers(0, 200))
def test_periodic_schedule_property(period, warmup):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        averager = lsgd_jax.PeriodicModelAverager(period, warmup)
    steps = np.arange(3000)
    want = [torch_periodic_level(int(s), period, warmup) for s in steps]
    assert [averager.level(int(s)) for s in steps] == want
    np.testing.assert_array_equal(jax.jit(averager.level)(jnp.asarray(steps, jnp.int32)), want)


@settings(max_examples=60, deadline=None)
@given(
    periods=st.lists(st.integers(1, 40), min_size=1, max_size=4, unique=True).map(sorted),
    warmup=st.integers(0, 200),
)
def test_hierarchical_schedule_property(periods, warmup):
    import warnings

    axes = ["local", ("node", "local"), ("pod", "node", "local"), ("dc", "pod", "node", "local")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        averager = lsgd_jax.HierarchicalModelAverager(dict(zip(periods, axes)), warmup)
    steps = np.arange(3000)
    want = [torch_hierarchical_level(int(s), periods, warmup) for s in steps]
    assert [averager.level(int(s)) for s in steps] == want
    np.testing.assert_array_equal(jax.jit(averager.level)(jnp.asarray(steps, jnp.int32)), want)
