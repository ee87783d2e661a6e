"""The model averagers, against PyTorch's own tests and a plain-Python schedule model."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    DATA,
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
