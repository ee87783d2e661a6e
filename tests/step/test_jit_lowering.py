"""The plain-jit lowering: the loss under jax.jit (vmapped over replicas), the same
collectives and numbers as the shard_map lowering; and lsgd_jax.stacked for a user's
own plain-jit step."""

import jax
import numpy as np
import optax
import pytest
from helpers import mesh_2x4, tiny_mlp

import lsgd_jax

GLOBAL = ("node", "local")


init, loss_fn = tiny_mlp()  # 6 -> 8 -> 1


def make_tx():
    return optax.chain(
        lsgd_jax.post_local_sgd(3, post_local_gradient_allreduce=False),
        optax.adam(0.05),
        lsgd_jax.model_averaging(lsgd_jax.HierarchicalModelAverager({1: "local", 3: GLOBAL}, 3)),
    )


def batches(steps=9):
    rng = np.random.default_rng(2)
    return [
        {
            "x": rng.standard_normal((32, 6), np.float32),
            "y": rng.standard_normal((32, 1), np.float32),
        }
        for _ in range(steps)
    ]


def trajectory(step, tx):
    mesh = mesh_2x4()
    p, s = lsgd_jax.replicate(init(), mesh), lsgd_jax.replicate(tx.init(init()), mesh)
    out = []
    for b in batches():
        p, s, loss = step(p, s, b)
        out.append((np.asarray(p["w1"]), float(loss)))
    return out


def collectives(report):
    return sorted((c.kind, c.group_size, c.bytes, c.conditional) for c in report)


@pytest.mark.parametrize("specialize", [True, "switch", False])
def test_the_jit_lowering_gives_the_shard_map_numbers(specialize):
    mesh = mesh_2x4()
    tx = make_tx()
    want = trajectory(lsgd_jax.data_parallel_step(loss_fn, tx, mesh, specialize=specialize), tx)
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, specialize=specialize, lowering="jit")
    got = trajectory(step, tx)
    for (gp, gl), (wp, wl) in zip(got, want):
        np.testing.assert_allclose(gp, wp, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gl, wl, rtol=1e-5)


def test_the_jit_lowering_has_the_same_collectives_all_conditional():
    mesh = mesh_2x4()
    tx = make_tx()
    args = (lsgd_jax.replicate(init(), mesh), lsgd_jax.replicate(tx.init(init()), mesh))
    b = batches(1)[0]
    reports = {
        low: lsgd_jax.data_parallel_step(loss_fn, tx, mesh, lowering=low).communication_report(
            *args, b
        )
        for low in ("shard_map", "jit")
    }
    assert collectives(reports["jit"]) == collectives(reports["shard_map"])
    n_params = 6 * 8 + 8
    big = [c for c in reports["jit"] if c.bytes >= n_params * 4 // 2]
    assert big and all(c.conditional for c in big)  # no parameter-sized one every step


def test_a_users_own_plain_jit_step_with_stacked():
    mesh = mesh_2x4()
    tx = make_tx()
    stx = lsgd_jax.stacked(tx, mesh)

    @jax.jit
    def step(params, opt_state, batch):  # no shard_map here
        rows = jax.tree.map(lambda x: x.reshape(8, -1, *x.shape[1:]), batch)
        loss, grads = jax.vmap(jax.value_and_grad(loss_fn))(params, rows)
        updates, opt_state = stx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss.mean()

    p = lsgd_jax.replicate(init(), mesh)
    s = stx.init(p)
    assert jax.tree.structure(s) == jax.tree.structure(lsgd_jax.replicate(tx.init(init()), mesh))
    want = trajectory(lsgd_jax.data_parallel_step(loss_fn, tx, mesh, specialize=False), tx)
    for b, (wp, wl) in zip(batches(), want):
        p, s, loss = step(p, s, b)
        np.testing.assert_allclose(np.asarray(p["w1"]), wp, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(loss), wl, rtol=1e-5)
    report = lsgd_jax.communication_report(step, p, s, batches(1)[0])
    data = [c for c in report if c.bytes > 4]
    assert data and all(c.conditional for c in data)


def test_unknown_lowering_is_refused():
    with pytest.raises(ValueError, match="lowering must be one of"):
        lsgd_jax.data_parallel_step(loss_fn, make_tx(), mesh_2x4(), lowering="pjit")
