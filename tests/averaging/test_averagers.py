"""The model averagers, against PyTorch's own tests and a plain-Python schedule model;
their non-finite policies (``nonfinite=``) and their means of bfloat16 params."""

import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    DATA,
    drain_callback_errors,
    group_means,
    mesh_2x4,
    put,
    rank_values,
    smap,
    squeeze,
    torch_hierarchical_level,
    torch_periodic_level,
    types_of,
    unsqueeze,
)
from jax.sharding import PartitionSpec as P

import lsgd_jax


def averaging_fn(averager, mesh, per_replica_state, spec=DATA):
    """A jitted ``(params, state) -> (params, state)`` over per-replica params."""
    if per_replica_state:

        def body(params, state):
            p, s = averager.average_parameters(squeeze(params), squeeze(state))
            return unsqueeze(p), unsqueeze(s)

        return smap(body, mesh, (spec, spec), (spec, spec))

    def body(params, state):
        p, s = averager.average_parameters(squeeze(params), state)
        return unsqueeze(p), s

    return smap(body, mesh, (spec, P()), (spec, P()))


def init_state(averager, mesh, per_replica_state, spec=DATA):
    state = averager.init()
    if per_replica_state:
        n = mesh.devices.size
        return put(jax.tree.map(lambda x: jnp.broadcast_to(x, (n,)), state), mesh, spec)
    return put(state, mesh, P())


@pytest.mark.parametrize("per_replica_state", [False, True])
@pytest.mark.parametrize("warmup_steps", [12, 13, 14, 15])
def test_periodic_model_averager_matches_pytorch_test(warmup_steps, per_replica_state):
    # PyTorch's test_periodic_model_averager: params reset to rank * ones every step;
    # averaged exactly when step >= warmup and (step - warmup) % period == 0.
    mesh = mesh_2x4()
    period = 4
    averager = lsgd_jax.PeriodicModelAverager(period=period, warmup_steps=warmup_steps)
    f = averaging_fn(averager, mesh, per_replica_state)
    state = init_state(averager, mesh, per_replica_state)
    tensor = put(rank_values(8), mesh, DATA)
    expected_avg = np.full((8, 5), sum(range(8)) / 8)
    averaged_at = []
    for step in range(20):
        out, state = f(tensor, state)
        if torch_periodic_level(step, period, warmup_steps):
            np.testing.assert_array_equal(out, expected_avg)
            averaged_at.append(step)
        else:
            np.testing.assert_array_equal(out, tensor)
    assert averaged_at == [s for s in (warmup_steps, warmup_steps + 4) if s < 20]
    assert int(np.asarray(state.step).ravel()[0]) == 20


@pytest.mark.parametrize("warmup_steps", [12, 13, 14, 15])
def test_1_level_hierarchical_model_averager(warmup_steps):
    # PyTorch's test of this name overwrites its hierarchical averager with a periodic one
    # before using it, so it never checks the hierarchical rule. The rules agree exactly
    # when warmup_steps % period == 0; otherwise the hierarchical one averages at
    # step % period == 0 (not (step - warmup) % period == 0), which we check here.
    mesh = mesh_2x4()
    period = 4
    hier = lsgd_jax.HierarchicalModelAverager({period: ("node", "local")}, warmup_steps)
    periodic = lsgd_jax.PeriodicModelAverager(period, warmup_steps)
    f = averaging_fn(hier, mesh, False)
    state = init_state(hier, mesh, False)
    tensor = put(rank_values(8), mesh, DATA)
    for step in range(20):
        out, state = f(tensor, state)
        want = torch_hierarchical_level(step, [period], warmup_steps)
        assert hier.level(step) == want
        if warmup_steps % period == 0:
            assert want == periodic.level(step)
        np.testing.assert_array_equal(out, np.full((8, 5), 3.5) if want else tensor)


@pytest.mark.parametrize("per_replica_state", [False, True])
def test_3_level_hierarchical_model_averager_on_2x2x2_mesh(per_replica_state):
    # PyTorch's test_3_level_hierarchical_model_averager, on 8 replicas: groups of 2
    # ("local") every 2 steps, of 4 ("node", "local") every 4, all 8 every 8; warm-up 10.
    devices = np.array(jax.devices()[:8]).reshape(2, 2, 2)
    mesh = jax.sharding.Mesh(devices, ("pod", "node", "local"))
    spec = P(("pod", "node", "local"))
    averager = lsgd_jax.HierarchicalModelAverager(
        {2: "local", 4: ("node", "local"), 8: ("pod", "node", "local")}, warmup_steps=10
    )
    f = averaging_fn(averager, mesh, per_replica_state, spec)
    state = init_state(averager, mesh, per_replica_state, spec)
    tensor = put(rank_values(8), mesh, spec)
    ranks = np.asarray(tensor)
    for step in range(25):
        out, state = f(tensor, state)
        if step in (16, 24):
            want = group_means(ranks, 8)
        elif step in (12, 20):
            want = group_means(ranks, 4)
        elif step in (10, 14, 18, 22):
            want = group_means(ranks, 2)
        else:
            want = ranks
        np.testing.assert_array_equal(out, want)
        assert averager.level(step) == torch_hierarchical_level(step, [2, 4, 8], 10)


@pytest.mark.parametrize("period", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("warmup", [0, 1, 4, 7])
def test_levels_match_plain_python_model(period, warmup):
    periodic = lsgd_jax.PeriodicModelAverager(period, warmup) if period > 1 else None
    hier = lsgd_jax.HierarchicalModelAverager({period: "local", 2 * period + 1: None}, warmup)
    steps = jnp.arange(200)
    for s in range(200):
        want = torch_hierarchical_level(s, [period, 2 * period + 1], warmup)
        assert hier.level(s) == want
        if periodic is not None:
            assert periodic.level(s) == torch_periodic_level(s, period, warmup)
    np.testing.assert_array_equal(
        hier.level(steps),
        [torch_hierarchical_level(s, [period, 2 * period + 1], warmup) for s in range(200)],
    )
    if periodic is not None:
        np.testing.assert_array_equal(
            periodic.level(steps), [torch_periodic_level(s, period, warmup) for s in range(200)]
        )


def test_average_parameters_makes_replicas_bitwise_identical():
    mesh = mesh_2x4()
    averager = lsgd_jax.PeriodicModelAverager(2)
    f = averaging_fn(averager, mesh, False)
    key = jax.random.key(0)
    params = {
        "w": jax.random.normal(key, (8, 1000, 100)),
        "h": jax.random.normal(key, (8, 3000)).astype(jnp.bfloat16),
        "count": jnp.arange(8, dtype=jnp.int32),  # integer leaves are not averaged
    }
    out, _ = f(put(params, mesh, DATA), init_state(averager, mesh, False))
    for name in ("w", "h"):
        leaf = np.asarray(out[name].astype(jnp.float32))
        assert out[name].dtype == params[name].dtype
        for r in range(1, 8):
            np.testing.assert_array_equal(leaf[r], leaf[0])
        np.testing.assert_allclose(
            leaf[0], np.asarray(params[name], np.float32).mean(0), rtol=2e-2, atol=2e-2
        )
    np.testing.assert_array_equal(out["count"], params["count"])


def test_averager_state_is_type_stable_and_scannable():
    mesh = mesh_2x4()
    averager = lsgd_jax.HierarchicalModelAverager({2: "local", 4: ("node", "local")})

    def body(params, state):
        params = squeeze(params)
        before = types_of((params, state))
        p, s = averager.average_parameters(params, state)
        assert types_of((p, s)) == before

        def scan_step(carry, _):
            return averager.average_parameters(*carry), None

        (p, s), _ = jax.lax.scan(scan_step, (p, s), length=6)
        return unsqueeze(p), s

    f = smap(body, mesh, (DATA, P()), (DATA, P()))
    out, state = f(put(rank_values(8), mesh, DATA), put(averager.init(), mesh, P()))
    assert int(state.step) == 7
    assert state.step.dtype == jnp.int32


INT32_MAX = int(np.iinfo(np.int32).max)


@pytest.mark.parametrize(
    "averager",
    [
        lsgd_jax.PeriodicModelAverager(4),
        lsgd_jax.PeriodicModelAverager(3, warmup_steps=1),
        lsgd_jax.PeriodicModelAverager(6, warmup_steps=5, fragments=3),
        lsgd_jax.HierarchicalModelAverager({2: "local", 3: ("node", "local")}, warmup_steps=7),
    ],
    ids=["periodic", "periodic-warmup", "fragments", "hierarchical"],
)
def test_the_schedule_stays_right_past_the_int32_maximum(averager):
    # A saturating counter used to stop PeriodicModelAverager(4) forever and made
    # PeriodicModelAverager(3, warmup_steps=1) average at every step.
    mesh = mesh_2x4()
    rank = put(rank_values(8), mesh, DATA)

    def body(params, state, rank):
        p, s = averager.average_parameters(squeeze(params) + squeeze(rank), state)
        return unsqueeze(p), s

    f = smap(body, mesh, (DATA, P(), DATA), (DATA, P()))
    first = INT32_MAX - 9
    state = put(averager.init().replace(step=jnp.int32(first)), mesh, P())
    params = put(jnp.zeros((8, 5)), mesh, DATA)
    got, want = [], []
    for true_step in range(first, first + 24):  # Python ints: no overflow here
        params, state = f(params, state, rank)
        level = averager.level(true_step)  # the rule, on the true (unbounded) count
        want.append(level)
        values = np.asarray(params)
        if level and averager.groups[level - 1 if len(averager.groups) > 1 else 0] == ("local",):
            values = values.reshape(2, 4, 5)[0]  # the first node's replicas
        spread = np.ptp(values, axis=0)  # per element, over the group's replicas
        k = getattr(averager, "fragments", 1)
        chunk = -(-5 // k)
        region = spread[(level - 1) * chunk : level * chunk] if level and k > 1 else spread
        got.append(level if (region.max() == 0) == bool(level) else -1)
    assert got == want
    assert any(want[10:]), "the window must hold averages past the maximum"
    assert 0 <= int(state.step) <= INT32_MAX


def test_a_callable_period_fails_loudly_at_the_int32_maximum():
    mesh = mesh_2x4()
    averager = lsgd_jax.PeriodicModelAverager(lambda s: jnp.where(s < 100, 2, 4))
    f = averaging_fn(averager, mesh, False)
    state = averager.init().replace(step=jnp.int32(INT32_MAX), last_sync=jnp.int32(INT32_MAX - 1))
    with pytest.raises(Exception, match="reached the int32 maximum"):
        _, state = f(put(rank_values(8), mesh, DATA), put(state, mesh, P()))
        jax.block_until_ready(state)
    drain_callback_errors()


# --- bad input ------------------------------------------------------------------------


@pytest.mark.parametrize("period", [0, -3])
def test_period_below_one_is_rejected(period):
    with pytest.raises(ValueError, match=f"period must be a positive int, got {period}"):
        lsgd_jax.PeriodicModelAverager(period)


def test_negative_warmup_is_rejected():
    with pytest.raises(ValueError, match="warmup_steps must be a non-negative int, got -1"):
        lsgd_jax.PeriodicModelAverager(4, warmup_steps=-1)
    with pytest.raises(ValueError, match="warmup_steps"):
        lsgd_jax.HierarchicalModelAverager({4: None}, warmup_steps=-1)


def test_non_integer_period_is_rejected():
    with pytest.raises(TypeError, match="period must be a Python int, got 2.5"):
        lsgd_jax.PeriodicModelAverager(2.5)


def test_period_one_warns_as_pytorch_does():
    with pytest.warns(UserWarning, match="When period is 1"):
        lsgd_jax.PeriodicModelAverager(1)
    with pytest.warns(UserWarning, match="When period is 1"):
        lsgd_jax.HierarchicalModelAverager({1: None})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lsgd_jax.PeriodicModelAverager(2)
        lsgd_jax.HierarchicalModelAverager({1: "local", 2: None})


@pytest.mark.parametrize(
    "groups, message",
    [
        ({}, "must be a non-empty dict"),
        ({0: "local", 4: None}, "must be a positive int, got 0"),
        ({4: "local", 2: None}, r"strictly increasing .* got \[4, 2\]"),
        ({2: ("node", "local"), 4: "local"}, "must be nested"),
        ({2: None, 4: ("node", "local")}, "Only the last"),
        ({2: "local", 4: "node", 8: ("node", "local")}, "must be nested"),
        (
            {
                2: lsgd_jax.IndexGroups("i", [[0, 1], [2, 3]]),
                4: lsgd_jax.IndexGroups("i", [[0, 2], [1, 3]]),
            },
            "must be nested",
        ),
    ],
)
def test_bad_hierarchies_are_rejected(groups, message):
    with pytest.raises(ValueError, match=message):
        lsgd_jax.HierarchicalModelAverager(groups)


def test_last_group_must_be_global():
    with pytest.raises(ValueError, match="last group .* must be the global group"):
        lsgd_jax.HierarchicalModelAverager({2: "local"}, process_group=("node", "local"))
    # Without process_group, the check runs where the axes are bound.
    mesh = mesh_2x4()
    averager = lsgd_jax.HierarchicalModelAverager({2: "local"})
    f = averaging_fn(averager, mesh, False)
    with pytest.raises(ValueError, match="last group .* must be the global group"):
        f(put(rank_values(8), mesh, DATA), put(averager.init(), mesh, P()))


def test_unbound_axis_names_the_axis_and_the_fix():
    mesh = mesh_2x4()
    averager = lsgd_jax.PeriodicModelAverager(4, process_group=("pod", "node"))
    f = averaging_fn(averager, mesh, False)
    with pytest.raises(lsgd_jax.AxisNotBoundError, match="'pod' is not bound here") as e:
        f(put(rank_values(8), mesh, DATA), put(averager.init(), mesh, P()))
    assert "shard_map" in str(e.value) and "('node', 'local')" in str(e.value)


def test_outside_any_mapped_axis_is_a_clear_error():
    averager = lsgd_jax.PeriodicModelAverager(4)
    with pytest.raises(lsgd_jax.AxisNotBoundError, match="no mapped axis is bound"):
        jax.jit(averager.average_parameters)(jnp.ones(3), averager.init())


def test_wrong_state_type_is_rejected():
    with pytest.raises(TypeError, match="ModelAveragerState"):
        lsgd_jax.PeriodicModelAverager(4).average_parameters(jnp.ones(3), 0)


def test_averagers_are_hashable_configs():
    a = lsgd_jax.PeriodicModelAverager(4, 2)
    assert a == lsgd_jax.PeriodicModelAverager(4, 2) and hash(a) == hash(
        lsgd_jax.PeriodicModelAverager(4, 2)
    )
    h = lsgd_jax.HierarchicalModelAverager({2: "local", 4: ("node", "local")})
    assert h.periods == (2, 4) and h.groups == (("local",), ("node", "local"))
    with pytest.raises(AttributeError):
        a.period = 3


# --- non-finite params (nonfinite=: propagate, exclude, skip) and bf16 means -------------


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
