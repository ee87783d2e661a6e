"""Options beyond PyTorch: outer optimizers, optimizer-state averaging, compressed and
delta averaging, period schedules, fragment (streaming) averaging."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import DATA, mesh_2x4, put, smap, squeeze, unsqueeze
from jax.sharding import PartitionSpec as P

import lsgd_jax


def local_run(averager, steps, seed=0, shape=(64,), extra=None):
    """Replicas take random local steps; the averager runs after each. Returns history."""
    mesh = mesh_2x4()
    p0 = {"w": jax.random.normal(jax.random.key(seed), shape), "b": jnp.zeros(3)}

    def body(params, state, noise):
        params = squeeze(params)
        params = jax.tree.map(lambda x, n: x + 0.1 * n, params, squeeze(noise))
        params, state = averager.average_parameters(params, state)
        return unsqueeze(params), state

    f = smap(body, mesh, (DATA, P(), DATA), (DATA, P()))
    params = lsgd_jax.replicate(p0, mesh)
    state = put(averager.init(p0), mesh, P())
    out = []
    for s in range(steps):
        key = jax.random.key(1000 * seed + s)
        noise = jax.tree.map(lambda x, k=key: jax.random.normal(k, (8, *x.shape)), p0)
        params, state = f(params, state, put(noise, mesh, DATA))
        out.append(jax.tree.map(np.asarray, params))
    return out, state


# --- 1. outer optimizer ---------------------------------------------------------------


@pytest.mark.parametrize("make", ["periodic", "hierarchical"])
def test_outer_sgd_one_is_plain_averaging_exactly(make):
    if make == "periodic":
        plain = lsgd_jax.PeriodicModelAverager(3, warmup_steps=2)
        outer = lsgd_jax.PeriodicModelAverager(3, warmup_steps=2, outer_optimizer=optax.sgd(1.0))
    else:
        groups = {2: "local", 4: ("node", "local")}
        plain = lsgd_jax.HierarchicalModelAverager(groups, warmup_steps=2)
        outer = lsgd_jax.HierarchicalModelAverager(groups, 2, outer_optimizer=optax.sgd(1.0))
    a, _ = local_run(plain, 12)
    b, state = local_run(outer, 12)
    for x, y in zip(a, b):
        for name in x:
            np.testing.assert_array_equal(x[name], y[name])  # bit for bit
    assert state.anchor is not None


def test_outer_nesterov_matches_a_hand_computed_reference():
    lr, mom, period, warmup, steps = 0.7, 0.9, 3, 1, 11
    averager = lsgd_jax.PeriodicModelAverager(
        period, warmup, outer_optimizer=optax.sgd(lr, momentum=mom, nesterov=True)
    )
    hist, _ = local_run(averager, steps, shape=(32,))
    # Reference in float64: replay the same local noise, then DiLoCo's outer step.
    p0 = {
        "w": np.asarray(jax.random.normal(jax.random.key(0), (32,)), np.float64),
        "b": np.zeros(3),
    }
    params = {k: np.broadcast_to(v, (8, *v.shape)).copy() for k, v in p0.items()}
    anchor = {k: v.copy() for k, v in p0.items()}
    buf = {k: np.zeros_like(v) for k, v in p0.items()}
    first = True
    for s in range(steps):
        for k in params:
            noise = np.asarray(jax.random.normal(jax.random.key(s), (8, *p0[k].shape)), np.float64)
            params[k] = params[k] + 0.1 * noise
        if s >= warmup and (s - warmup) % period == 0:
            for k in params:
                if first:  # the first global average only sets the anchor
                    anchor[k] = params[k].mean(0)
                else:
                    g = anchor[k] - params[k].mean(0)  # pseudo-gradient: old minus new
                    buf[k] = g + mom * buf[k]
                    anchor[k] = anchor[k] - lr * (g + mom * buf[k])  # Nesterov, descent
                params[k] = np.broadcast_to(anchor[k], params[k].shape).copy()
            first = False
        for k in params:
            np.testing.assert_allclose(hist[s][k], params[k], rtol=2e-5, atol=2e-6)


def test_outer_step_moves_along_the_averaged_direction():
    # Sign convention (torchft once shipped it inverted): with lr > 1 the outer step
    # extrapolates past the mean, away from the anchor, never back through it.
    averager = lsgd_jax.PeriodicModelAverager(
        2,
        outer_optimizer=optax.sgd(2.0),
        outer_skip_first=False,  # anchor: the init params
    )
    plain = lsgd_jax.PeriodicModelAverager(2)
    p0 = np.asarray(jax.random.normal(jax.random.key(0), (64,)))
    hist, _ = local_run(averager, 3, shape=(64,))
    ref, _ = local_run(plain, 3, shape=(64,))
    # step 0 averages (anchor = p0) ... step 2 again: compare the move from the anchor
    moved = hist[0]["w"][0] - p0
    mean_move = ref[0]["w"][0] - p0
    np.testing.assert_allclose(moved, 2 * mean_move, rtol=1e-4, atol=1e-6)
    assert float(np.dot(moved, mean_move)) > 0


def test_first_global_average_only_sets_the_anchor_by_default():
    outer = lsgd_jax.PeriodicModelAverager(2, outer_optimizer=optax.sgd(2.0))
    plain = lsgd_jax.PeriodicModelAverager(2)
    a, state = local_run(outer, 3)
    b, _ = local_run(plain, 3)
    np.testing.assert_array_equal(a[0]["w"], b[0]["w"])  # step 0: a plain average
    assert not np.allclose(a[2]["w"], b[2]["w"])  # step 2: an outer step (lr 2)
    assert int(state.outer_count) == 2


def test_outer_optimizer_needs_params_at_init():
    averager = lsgd_jax.PeriodicModelAverager(2, outer_optimizer=optax.sgd(0.7))
    with pytest.raises(ValueError, match=r"init\(params\)"):
        averager.init()
    with pytest.raises(TypeError, match="optax GradientTransformation"):
        lsgd_jax.PeriodicModelAverager(2, outer_optimizer=0.7)


def test_outer_optimizer_through_model_averaging():
    mesh = mesh_2x4()
    averager = lsgd_jax.PeriodicModelAverager(2, outer_optimizer=optax.sgd(1.0))
    tx = optax.chain(optax.sgd(0.1), lsgd_jax.model_averaging(averager))
    plain = optax.chain(optax.sgd(0.1), lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2)))

    def make(t):
        def body(params, opt_state, x):
            params, opt_state = squeeze(params), squeeze(opt_state)
            g = jax.grad(lambda p: jnp.mean((x[0] @ p) ** 2))(params)
            u, opt_state = t.update(g, opt_state, params)
            return unsqueeze(optax.apply_updates(params, u)), unsqueeze(opt_state)

        return smap(body, mesh, (DATA, DATA, DATA), (DATA, DATA))

    p0 = jnp.ones(5)
    runs = []
    for t in (tx, plain):
        f, p, s = make(t), lsgd_jax.replicate(p0, mesh), lsgd_jax.replicate(t.init(p0), mesh)
        for i in range(5):
            p, s = f(p, s, put(jax.random.normal(jax.random.key(i), (8, 4, 5)), mesh, DATA))
        runs.append(np.asarray(p))
    np.testing.assert_allclose(runs[0], runs[1], rtol=1e-6, atol=1e-7)


# --- 2. optimizer-state averaging -------------------------------------------------------


@pytest.mark.parametrize("mask_kind", ["callable", "tree"])
def test_momentum_buffers_are_averaged_with_the_params(mask_kind):
    mesh = mesh_2x4()
    averager = lsgd_jax.PeriodicModelAverager(3, warmup_steps=1)
    inner = optax.sgd(0.05, momentum=0.9)
    p0 = {"w": jnp.ones((6, 2)), "b": jnp.zeros(2)}
    if mask_kind == "callable":
        mask = lambda s: jax.tree.map(lambda x: jnp.ndim(x) > 0, s)  # noqa: E731
    else:
        mask = jax.tree.map(lambda _: True, inner.init(p0))
    txs = {
        "avg": lsgd_jax.post_local_sgd_optimizer(inner, averager, average_opt_state=mask),
        "plain": lsgd_jax.post_local_sgd_optimizer(inner, averager),
    }
    out = {}
    for name, tx in txs.items():

        def body(params, opt_state, x, tx=tx):
            params, opt_state = squeeze(params), squeeze(opt_state)
            g = jax.grad(lambda q: jnp.mean((x[0] @ q["w"] + q["b"]) ** 2))(params)
            u, opt_state = tx.update(g, opt_state, params)
            return unsqueeze(optax.apply_updates(params, u)), unsqueeze(opt_state)

        f = smap(body, mesh, (DATA, DATA, DATA), (DATA, DATA))
        p, s = lsgd_jax.replicate(p0, mesh), lsgd_jax.replicate(tx.init(p0), mesh)
        traces = []
        for i in range(5):
            p, s = f(p, s, put(jax.random.normal(jax.random.key(i), (8, 4, 6)), mesh, DATA))
            traces.append(np.asarray(s.inner_state[0].trace["w"]))
        out[name] = (traces, f, p, s)
    for i in range(5):
        t_avg, t_plain = out["avg"][0][i], out["plain"][0][i]
        if averager.level(i):
            assert all(np.array_equal(t_avg[r], t_avg[0]) for r in range(8))  # exact mean
            assert not np.allclose(t_plain[0], t_plain[4])  # PyTorch: never averaged
            np.testing.assert_allclose(t_avg[0], t_plain.mean(0) if i == 1 else t_avg[0], rtol=1e-5)
    # same collective: one all-reduce per averaging step, carrying params + momentum
    _, f, p, s = out["avg"]
    report = lsgd_jax.communication_report(f, p, s, put(jnp.ones((8, 4, 6)), mesh, DATA))
    (c,) = report
    assert c.conditional and c.bytes == 2 * (6 * 2 + 2) * 4


def test_bad_opt_state_mask_is_rejected():
    tx = lsgd_jax.post_local_sgd_optimizer(
        optax.sgd(0.1, momentum=0.9), lsgd_jax.PeriodicModelAverager(2), average_opt_state=[True]
    )
    with pytest.raises(ValueError, match="structure of the inner optimizer's state"):
        tx.init({"w": jnp.ones(2)})


# --- 3. cheaper averaging ---------------------------------------------------------------


def test_bf16_communication_with_delta_is_accurate_and_halves_the_bytes():
    mesh = mesh_2x4()
    n = 4096
    p0 = {"w": jax.random.normal(jax.random.key(0), (n,)) * 10.0}
    exact = lsgd_jax.PeriodicModelAverager(2)
    bf16 = lsgd_jax.PeriodicModelAverager(2, communication_dtype=jnp.bfloat16)
    delta = lsgd_jax.PeriodicModelAverager(2, communication_dtype=jnp.bfloat16, delta=True)
    results = {}
    for name, averager in {"exact": exact, "bf16": bf16, "delta": delta}.items():

        def body(params, state, noise, averager=averager):
            params = jax.tree.map(lambda x, z: x + 1e-2 * z, squeeze(params), squeeze(noise))
            params, state = averager.average_parameters(params, state)
            return unsqueeze(params), state

        f = smap(body, mesh, (DATA, P(), DATA), (DATA, P()))
        args = (
            lsgd_jax.replicate(p0, mesh),
            put(averager.init(p0), mesh, P()),
            put({"w": jax.random.normal(jax.random.key(1), (8, n))}, mesh, DATA),
        )
        out, _ = f(*args)
        w = np.asarray(out["w"])
        assert all(np.array_equal(w[r], w[0]) for r in range(8))  # replicas identical
        results[name] = w[0]
        if name != "exact":
            report = lsgd_jax.communication_report(f, *args, platform="cuda")
            kinds = sorted((c.kind, c.bytes, c.conditional) for c in report)
            assert kinds == [("all-gather", n * 2 // 8, True), ("all-to-all", n * 2, True)]
            # on the wire: half of a float32 ring all-reduce (2 * 7/8 * 4n bytes)
            assert sum(c.wire_bytes for c in report) == round(2 * 7 / 8 * 4 * n) // 2
    err_bf16 = np.abs(results["bf16"] - results["exact"]).max()
    err_delta = np.abs(results["delta"] - results["exact"]).max()
    assert err_bf16 > 1e-3  # params rounded to bf16 (|w| ~ 10: steps of ~0.03)
    assert err_delta < 1e-4 * err_bf16 * 1e2  # only the tiny change is rounded
    assert err_delta < 5e-5


def test_compression_options_are_validated():
    with pytest.raises(ValueError, match="floating dtype"):
        lsgd_jax.PeriodicModelAverager(2, communication_dtype=jnp.int8)
    with pytest.raises(ValueError, match="nonfinite='propagate' only"):
        lsgd_jax.PeriodicModelAverager(2, communication_dtype=jnp.bfloat16, nonfinite="exclude")


# --- 4. period schedules ----------------------------------------------------------------


def test_period_schedule_is_one_replicated_cond_per_step():
    period = lambda s: jnp.where(s < 12, 6, 2)  # noqa: E731  rarely first, then often
    averager = lsgd_jax.PeriodicModelAverager(period, warmup_steps=3)
    want = averager.schedule(24)
    assert np.flatnonzero(want).tolist() == [3, 9, 12, 14, 16, 18, 20, 22]
    hist, state = local_run(averager, 24)
    for s in range(24):
        w = hist[s]["w"]
        assert all(np.array_equal(w[r], w[0]) for r in range(8)) == bool(want[s])
    assert int(state.last_sync) == 22
    with pytest.raises(TypeError, match="schedule"):
        averager.level(3)


def test_constant_schedule_equals_the_int_period():
    a = lsgd_jax.PeriodicModelAverager(lambda s: 4, warmup_steps=5)
    b = lsgd_jax.PeriodicModelAverager(4, warmup_steps=5)
    np.testing.assert_array_equal(a.schedule(100), b.schedule(100))


# --- 5. fragment (streaming) averaging ---------------------------------------------------


def test_fragments_average_one_part_per_step_round_robin():
    mesh = mesh_2x4()
    averager = lsgd_jax.PeriodicModelAverager(4, warmup_steps=1, fragments=2)
    assert averager.schedule(10).tolist() == [0, 1, 0, 2, 0, 1, 0, 2, 0, 1]
    hist, _ = local_run(averager, 8, shape=(40,))
    # The 43 floats in flattened order, "b" (3) then "w" (40), cut in two equal slices:
    # fragment 1 = b + w[:19], fragment 2 = w[19:].
    synced = lambda x: all(np.array_equal(x[r], x[0]) for r in range(8))  # noqa: E731
    assert synced(hist[1]["b"]) and synced(hist[1]["w"][:, :19])
    assert not synced(hist[1]["w"][:, 19:])
    assert synced(hist[3]["w"][:, 19:]) and not synced(hist[3]["b"])
    # The compiled step: one switch, one all-reduce per fragment, each half the params.
    p0 = {"w": jnp.zeros(40), "b": jnp.zeros(3)}

    def body(p, s):
        p, s = averager.average_parameters(squeeze(p), s)
        return unsqueeze(p), s

    f = smap(body, mesh, (DATA, P()), (DATA, P()))
    report = lsgd_jax.communication_report(
        f, lsgd_jax.replicate(p0, mesh), put(averager.init(), mesh, P())
    )
    assert sorted(c.bytes for c in report) == [21 * 4, 22 * 4]
    assert all(c.conditional for c in report)
    assert averager.num_levels == 2 and averager.is_global(1) and averager.is_global(2)


def test_fragment_options_are_validated():
    with pytest.raises(ValueError, match="divisible"):
        lsgd_jax.PeriodicModelAverager(6, fragments=4)
    with pytest.raises(ValueError, match="not supported"):
        lsgd_jax.PeriodicModelAverager(4, fragments=2, outer_optimizer=optax.sgd(0.7))


def test_fragments_with_an_outer_optimizer_is_refused_naming_what_to_use():
    # issue 33: the refusal said "use one or the other", and no docstring said it
    with pytest.raises(ValueError) as refused:
        lsgd_jax.PeriodicModelAverager(4, fragments=2, outer_optimizer=optax.sgd(0.7))
    message = str(refused.value)
    assert message.startswith("fragments=2 with an outer_optimizer is not supported")
    assert "fragments=2 with a plain average (outer_optimizer=None)" in message
    assert "outer_optimizer on the whole model (fragments=1)" in message
    doc = " ".join(lsgd_jax.PeriodicModelAverager.__doc__.split())
    assert "not with an ``outer_optimizer``" in doc
