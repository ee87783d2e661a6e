"""fragments with a mixed ``average_opt_state`` mask: the chosen part of the momentum is
cut like the params, leaf by leaf where it holds one (issue 33), not averaged whole at
every fragment's average."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lsgd_jax
from lsgd_jax.averaging._fragments import Fragment


def arrays_only(inner_state):
    """docs/which_setup.md's mask: every array but the 0-d ones (counters, and the
    momentum of a 0-d param)."""
    return jax.tree.map(lambda x: jnp.ndim(x) > 0, inner_state)


def every_leaf(inner_state):
    return jax.tree.map(lambda x: True, inner_state)


def ledger(params, mask, fragments=4, period=8):
    mesh = lsgd_jax.make_mesh(2, 4)
    avg = lsgd_jax.PeriodicModelAverager(period, warmup_steps=0, fragments=fragments)
    tx = optax.chain(
        lsgd_jax.post_local_sgd(0, post_local_gradient_allreduce=False),
        lsgd_jax.post_local_sgd_optimizer(
            optax.sgd(0.1, momentum=0.9), avg, average_opt_state=mask
        ),
    )

    def loss_fn(p, b):
        return sum(jnp.sum(x) for x in jax.tree.leaves(p)) * b.mean()

    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, example_params=params)
    p, s = lsgd_jax.replicate(params, mesh), lsgd_jax.replicate(tx.init(params), mesh)
    return lsgd_jax.communication_ledger(step, p, s, jnp.ones(8), num_steps=period).per_step()


def test_a_masked_momentum_is_cut_like_the_params_in_the_ledger():
    # {"t": 0-d, "w": 1024}: 1025 floats in tree order (t, then w), 4 fragments of
    # ceil(1025 / 4) = 257 (the last 254), one every 2 steps. The mask leaves t's
    # momentum out, so fragment 1 sends t + w[:256] and w's momentum [:256]; the others
    # 257 params and their 257 momentum values. Every step also sends the loss (4 B).
    # Before: the momentum went whole at each average, 1028 + 4096 + 4 = 5128 B.
    params = {"w": jnp.zeros(1024), "t": jnp.zeros(())}
    want = [4 * (257 + 256) + 4, 4, 4 * 2 * 257 + 4, 4, 4 * 2 * 257 + 4, 4, 4 * 2 * 254 + 4, 4]
    assert ledger(params, arrays_only).tolist() == want
    # the all-True mask cuts the 0-d momentum with its param: only fragment 1 differs
    assert ledger(params, every_leaf).tolist() == [4 * 2 * 257 + 4, *want[1:]]


def replay(grads, warmup, period, fragments, lr, momentum):
    """NumPy replay of sgd(lr, momentum) on ``loss = sum(x * batch) + 0.5 |x|^2`` over
    the flat params ``[v, w0..w4]`` (v 0-d), 8 replicas, gradients global means before
    ``warmup``; a fragment's average means its slice of the params and of the momentum
    of ``w`` only (the mask leaves v's momentum, element 0, on its replica)."""
    n = grads.shape[-1]
    x, trace = np.zeros((8, n)), np.zeros((8, n))
    bounds = np.array_split(np.arange(n), fragments)
    out = []
    for t, g_batch in enumerate(grads):
        g = g_batch + x
        if t < warmup:
            g = np.broadcast_to(g.mean(0), g.shape)
        trace = g + momentum * trace
        x = x - lr * trace
        if t >= warmup and (t - warmup) % (period // fragments) == 0:
            k = ((t - warmup) // (period // fragments)) % fragments
            cut = bounds[k]
            x[:, cut] = x[:, cut].mean(0)
            held = cut[cut != 0]  # v's momentum is not chosen
            trace[:, held] = trace[:, held].mean(0)
        out.append(x.copy())
    return out


@pytest.mark.parametrize("specialize", ["phase", "switch"])
def test_a_masked_momentum_averages_element_by_element_with_its_params(specialize):
    # 6 floats (v, w0..w4), 2 fragments: v + w[:2], then w[2:]; the momentum of w
    # follows its elements (before: all of w's momentum at each fragment's average,
    # 0.06-0.08 off the replay from step 7 on)
    warmup, period, fragments = 2, 4, 2
    mesh = lsgd_jax.make_mesh(2, 4)
    avg = lsgd_jax.PeriodicModelAverager(period, warmup_steps=warmup, fragments=fragments)
    tx = optax.chain(
        lsgd_jax.post_local_sgd(warmup, post_local_gradient_allreduce=False),
        lsgd_jax.post_local_sgd_optimizer(
            optax.sgd(0.1, momentum=0.5), avg, average_opt_state=arrays_only
        ),
    )
    params = {"w": jnp.zeros((5,)), "v": jnp.zeros(())}

    def flat(p):
        return jnp.concatenate([p["v"][None], p["w"]])

    def loss_fn(p, b):
        return jnp.sum(flat(p) * b.mean(0)) + 0.5 * jnp.sum(flat(p) ** 2)

    step = lsgd_jax.data_parallel_step(
        loss_fn, tx, mesh, specialize=specialize, example_params=params
    )
    p, s = lsgd_jax.replicate(params, mesh), lsgd_jax.replicate(tx.init(params), mesh)
    rng = np.random.default_rng(0)
    batches = rng.normal(size=(12, 16, 6)).astype(np.float32)
    per_replica = batches.reshape(12, 8, 2, 6).mean(2).astype(np.float64)
    want = replay(per_replica, warmup, period, fragments, 0.1, 0.5)
    for t in range(12):
        p, s, _ = step(p, s, jnp.asarray(batches[t]))
        got = np.asarray(jax.vmap(flat)(p))
        np.testing.assert_allclose(got, want[t], rtol=1e-5, atol=1e-6, err_msg=f"step {t}")
    trace = np.asarray(s[1].inner_state[0].trace["v"])
    assert not np.allclose(trace, trace[0])  # v's momentum stayed each replica's own


def test_the_cut_lines_a_part_up_with_the_params_leaf_by_leaf():
    # params {"a": 3, "b": 1, "c": 2}: 6 floats, fragment 0 of 2 = a[0:3]; fragment 1
    # = b + c. A part that leaves "b" out (None, or optax's MaskedNode) gives c's slice
    # only; one with a leaf of another shape, or nothing held, is taken whole.
    params = {"a": jnp.zeros(3), "b": jnp.zeros(()), "c": jnp.zeros(2)}
    cut = Fragment(1, 2).cut(params)
    part = {"a": jnp.arange(3.0), "b": None, "c": jnp.array([7.0, 8.0])}
    extra = {"count": jnp.ones(()), "mu": part}
    count, pieces = cut.take_aligned(extra, params)
    assert count.shape == ()  # not params-shaped: whole
    assert [np.asarray(x).tolist() for x in pieces] == [[7.0, 8.0]]
    new = cut.put_aligned(extra, params, [count + 1, [jnp.array([-1.0, -2.0])]])
    assert new["mu"]["b"] is None and float(new["count"]) == 2.0
    assert new["mu"]["a"].tolist() == [0.0, 1.0, 2.0]
    assert new["mu"]["c"].tolist() == [-1.0, -2.0]
    masked = {"a": jnp.zeros(3), "b": optax.MaskedNode(), "c": jnp.zeros(2)}
    assert len(cut.take_aligned(masked, params)) == 1  # one part: c's slice
    other = {"a": jnp.zeros(4), "b": None, "c": jnp.zeros(2)}
    assert len(cut.take_aligned(other, params)) == 2  # a and c, whole
    assert cut.take_aligned({"a": None, "b": None, "c": None}, params) == []
