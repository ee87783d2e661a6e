"""The optax transformations: chains, inject_hyperparameters, MultiSteps, state types."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    DATA,
    group_means,
    linear_loss,
    mesh_2x4,
    put,
    smap,
    squeeze,
    train_step,
    unsqueeze,
)

import lsgd_jax

quad_loss = linear_loss


def make_step(tx, mesh):
    """A jitted per-replica step that also checks the state keeps its types."""
    return train_step(tx, mesh, check_types=True)


def init(tx, mesh, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {"w": jax.random.normal(k1, (6, 3)), "b": jnp.zeros(3)}
    return lsgd_jax.replicate(params, mesh), lsgd_jax.replicate(tx.init(params), mesh)


def data(mesh, step, n=8):
    return put(jax.random.normal(jax.random.key(100 + step), (n, 4, 6)), mesh, DATA)


def replicas_equal(tree):
    return all(bool(np.all(np.asarray(x) == np.asarray(x)[:1])) for x in jax.tree.leaves(tree))


def test_chain_with_adamw_averages_on_schedule_and_not_the_moments():
    mesh = mesh_2x4()
    start, period = 3, 4
    tx = optax.chain(
        lsgd_jax.post_local_sgd(start),
        optax.adamw(1e-2),
        lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(period, warmup_steps=start)),
    )
    step = make_step(tx, mesh)
    params, opt_state = init(tx, mesh)
    for s in range(12):
        params, opt_state = step(params, opt_state, data(mesh, s))
        if s < start:  # synchronous data parallel: replicas identical
            assert replicas_equal(params)
        elif (s - start) % period == 0:  # averaged, up to the rounding of apply_updates
            for x in jax.tree.leaves(params):
                np.testing.assert_allclose(x, np.broadcast_to(x[0], x.shape), rtol=1e-6, atol=1e-7)
        else:  # local steps: nodes drift apart
            assert not replicas_equal(params)
    hook_state, adam_state, avg_state = opt_state
    assert np.all(np.asarray(hook_state.iter) == start)
    assert np.all(np.asarray(avg_state.step) == 12)
    mu = adam_state[0].mu["w"]
    assert not np.allclose(mu[0], mu[4])  # moments are not averaged (PyTorch's rule)


def test_model_averaging_passes_updates_through_unchanged_off_schedule():
    mesh = mesh_2x4()
    averager = lsgd_jax.PeriodicModelAverager(3, warmup_steps=1)
    tx = lsgd_jax.model_averaging(averager)

    def body(updates, params, state):
        u, s = tx.update(squeeze(updates), state, squeeze(params))
        return unsqueeze(u), s

    f = smap(
        body, mesh, (DATA, DATA, jax.sharding.PartitionSpec()), (DATA, jax.sharding.PartitionSpec())
    )
    key = jax.random.key(3)
    updates = jax.random.normal(key, (8, 50))
    params = jax.random.normal(jax.random.fold_in(key, 1), (8, 50))
    state = tx.init(params[0])
    for s in range(7):
        out, state = f(put(updates, mesh, DATA), put(params, mesh, DATA), state)
        if averager.level(s):
            moved = np.asarray(params + out, np.float64)
            np.testing.assert_allclose(
                moved, group_means(np.asarray(params + updates), 8), atol=1e-6
            )
        else:
            np.testing.assert_array_equal(out, updates)  # bit for bit
    assert int(state.step) == 7


def test_model_averaging_without_params_is_a_clear_error():
    tx = lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2))
    with pytest.raises(
        ValueError, match=r"needs the current params: call tx.update\(grads, opt_state, params\)"
    ):
        tx.update({"w": jnp.ones(2)}, tx.init(None))
    tx = lsgd_jax.post_local_sgd_optimizer(optax.sgd(0.1), lsgd_jax.PeriodicModelAverager(2))
    with pytest.raises(ValueError, match="needs the current params"):
        tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))


def test_wrong_averager_type_is_rejected():
    with pytest.raises(TypeError, match="PeriodicModelAverager or HierarchicalModelAverager"):
        lsgd_jax.model_averaging(4)


def test_inject_hyperparameters_inside_and_around():
    mesh = mesh_2x4()
    inner = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
    hook = optax.inject_hyperparams(lsgd_jax.post_local_sgd, static_args=("start_localSGD_iter",))(
        start_localSGD_iter=2
    )
    tx = optax.chain(hook, inner, lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, 2)))
    step = make_step(tx, mesh)
    params, opt_state = init(tx, mesh)
    for s in range(5):
        params, opt_state = step(params, opt_state, data(mesh, s))
    assert np.all(np.asarray(opt_state[0].inner_state.iter) == 2)
    # A schedule change through the injected hyperparameter takes effect: lr 0 freezes.
    opt_state[1].hyperparams["learning_rate"] = jnp.zeros_like(
        opt_state[1].hyperparams["learning_rate"]
    )
    opt_state[1].inner_state[0].trace["w"] = jnp.zeros_like(opt_state[1].inner_state[0].trace["w"])
    opt_state[1].inner_state[0].trace["b"] = jnp.zeros_like(opt_state[1].inner_state[0].trace["b"])
    before = params
    params, opt_state = step(params, opt_state, data(mesh, 5))  # step 5: no averaging
    np.testing.assert_array_equal(params["w"], before["w"])


def test_multisteps_counts_optimizer_updates_not_mini_batches():
    mesh = mesh_2x4()
    k, start, period = 2, 2, 2
    chain = optax.chain(
        lsgd_jax.post_local_sgd(start),
        optax.sgd(0.05, momentum=0.9),
        lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(period, start)),
    )
    multi = optax.MultiSteps(chain, every_k_schedule=k)
    step_multi = make_step(multi, mesh)
    params_m, state_m = init(multi, mesh)

    # The same run without MultiSteps, on the mean gradient of each k mini-batches.
    def body(params, opt_state, xs):
        params, opt_state = squeeze(params), squeeze(opt_state)
        grads = [jax.grad(quad_loss)(params, xs[0, i]) for i in range(k)]
        grads = jax.tree.map(lambda *g: sum(g) / k, *grads)
        updates, opt_state = chain.update(grads, opt_state, params)
        return unsqueeze(optax.apply_updates(params, updates)), unsqueeze(opt_state)

    step_plain = smap(body, mesh, (DATA, DATA, DATA), (DATA, DATA))
    params_p, state_p = init(chain, mesh)
    updates = 5
    for u in range(updates):
        for i in range(k):
            params_m, state_m = step_multi(params_m, state_m, data(mesh, u * k + i))
        xs = jnp.stack([data(mesh, u * k + i) for i in range(k)], axis=1)
        params_p, state_p = step_plain(params_p, state_p, put(xs, mesh, DATA))
        for a, b in zip(jax.tree.leaves(params_m), jax.tree.leaves(params_p)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    hook_state, _, avg_state = state_m.inner_opt_state
    assert np.all(np.asarray(hook_state.iter) == start)
    assert np.all(np.asarray(avg_state.step) == updates)


def test_post_local_sgd_optimizer_restore_keeps_the_schedule():
    # PyTorch's test_post_localSGD_optimizer_step_reload: the averager's step survives a
    # state round trip, so the restored optimizer does not redo the warm-up.
    mesh = mesh_2x4()
    averager = lsgd_jax.PeriodicModelAverager(4, warmup_steps=3)
    tx = optax.chain(
        lsgd_jax.post_local_sgd(3), lsgd_jax.post_local_sgd_optimizer(optax.sgd(0.05), averager)
    )
    step = make_step(tx, mesh)
    params, opt_state = init(tx, mesh)
    for s in range(6):
        params, opt_state = step(params, opt_state, data(mesh, s))
    saved = jax.tree.map(np.asarray, opt_state)  # what a checkpoint holds
    assert isinstance(saved[1], lsgd_jax.PostLocalSGDOptimizerState)
    assert np.all(saved[1].averager_state.step == 6)
    restored = jax.tree.unflatten(jax.tree.structure(opt_state), jax.tree.leaves(saved))
    restored = jax.tree.map(lambda x: put(x, mesh, DATA), restored)
    p1, s1 = step(params, opt_state, data(mesh, 6))
    p2, s2 = step(params, restored, data(mesh, 6))
    for a, b in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2))):
        np.testing.assert_array_equal(a, b)
    # A fresh optimizer state would restart the schedule (warm-up again):
    fresh = lsgd_jax.replicate(tx.init(squeeze(params)), mesh)
    p3, _ = step(params, fresh, data(mesh, 6))
    assert not np.array_equal(p3["w"], p1["w"])


def test_hierarchical_chain_and_scan_over_steps():
    mesh = mesh_2x4()
    averager = lsgd_jax.HierarchicalModelAverager(
        {2: "local", 4: ("node", "local")}, warmup_steps=2
    )
    tx = optax.chain(
        lsgd_jax.post_local_sgd(2, post_local_gradient_allreduce=False),
        optax.sgd(0.05),
        lsgd_jax.model_averaging(averager),
    )

    def body(params, opt_state, xs):
        params, opt_state = squeeze(params), squeeze(opt_state)

        def one(carry, x):
            p, s = carry
            g = jax.grad(quad_loss)(p, x)
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), None

        (params, opt_state), _ = jax.lax.scan(one, (params, opt_state), xs[0])
        return unsqueeze(params), unsqueeze(opt_state)

    f = smap(body, mesh, (DATA, DATA, DATA), (DATA, DATA))
    params, opt_state = init(tx, mesh)
    xs = jax.random.normal(jax.random.key(5), (8, 8, 4, 6))  # 8 steps: ends at step 7
    params, opt_state = f(params, opt_state, put(xs, mesh, DATA))
    assert np.all(np.asarray(opt_state[2].step) == 8)
    xs = jax.random.normal(jax.random.key(6), (8, 1, 4, 6))  # step 8: global average
    params, opt_state = f(params, opt_state, put(xs, mesh, DATA))
    for x in jax.tree.leaves(params):
        np.testing.assert_allclose(x, np.broadcast_to(x[0], x.shape), rtol=1e-6, atol=1e-7)
