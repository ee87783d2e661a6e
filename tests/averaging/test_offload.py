"""An averager's buffers in host memory (``offload_state=True``): same numbers, less
device memory, on every step path."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lsgd_jax
from lsgd_jax import comm

START = 2


def loss_fn(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w"]) @ p["v"] - b["y"]) ** 2)


def init():
    k1, k2 = jax.random.split(jax.random.key(1))
    return {"w": jax.random.normal(k1, (6, 8)) * 0.4, "v": jax.random.normal(k2, (8, 1)) * 0.4}


def chain(offload):
    averager = lsgd_jax.PeriodicModelAverager(
        3,
        START,
        outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True),
        delay=1,
        communication=comm.quantized(8, error_feedback=True),
        offload_state=offload,
    )
    return optax.chain(
        lsgd_jax.post_local_sgd(START), optax.adam(0.05), lsgd_jax.model_averaging(averager)
    )


def train(offload, specialize=True, steps=10):
    mesh = lsgd_jax.make_mesh(2, 4)
    tx = chain(offload)
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, specialize=specialize)
    params = lsgd_jax.replicate(init(), mesh)
    opt_state = lsgd_jax.replicate(tx.init(init()), mesh)
    rng = np.random.default_rng(0)
    traj = []
    for _ in range(steps):
        x = rng.standard_normal((16, 6)).astype(np.float32)
        params, opt_state, _ = step(params, opt_state, {"x": x, "y": x[:, :1] ** 2})
        traj.append(jax.tree.map(np.asarray, params))
    return traj, opt_state


def kinds(tree):
    return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)}


def device_bytes(tree):
    return sum(
        s.data.nbytes
        for leaf in jax.tree.leaves(tree)
        if leaf.sharding.memory_kind != "pinned_host"
        for s in leaf.addressable_shards
    )


@pytest.mark.parametrize("specialize", [True, False])
def test_offloaded_buffers_give_the_same_numbers_from_host_memory(specialize):
    want, on_device = train(None, specialize)
    got, offloaded = train(True, specialize)
    for g, w in zip(got, want, strict=True):
        for name in g:
            np.testing.assert_array_equal(g[name], w[name])
    assert not np.allclose(got[-1]["w"][0], got[-1]["w"][4])  # nodes apart: averages matter
    (state,) = lsgd_jax.averager_states(offloaded)
    for name in ("anchor", "outer_state", "comm_state", "inflight_start", "inflight_mean"):
        value = getattr(state, name)
        assert value is not None and kinds(value) == {"pinned_host"}, name
    assert kinds(state.step) == {"device"}  # the counters stay: the phase is read from them
    # what left the device: the five buffers (about 5x the params), nothing else
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(init())) * 8
    saved = device_bytes(on_device) - device_bytes(offloaded)
    assert saved >= 4 * params_bytes


def test_replicate_places_an_offloaded_averager_and_a_plain_one_stays():
    mesh = lsgd_jax.make_mesh(2, 4)
    off = lsgd_jax.replicate(chain(True).init(init()), mesh)
    (state,) = lsgd_jax.averager_states(off)
    assert kinds(state.anchor) == {"pinned_host"} and kinds(state.step) == {"device"}
    (plain,) = lsgd_jax.averager_states(lsgd_jax.replicate(chain(None).init(init()), mesh))
    assert kinds(plain.anchor) == {"device"}


def test_offload_state_is_a_flag_and_false_is_the_default():
    with pytest.raises(TypeError, match="offload_state must be True or False, got 1"):
        lsgd_jax.PeriodicModelAverager(2, offload_state=1)
    assert lsgd_jax.PeriodicModelAverager(2, offload_state=False) == lsgd_jax.PeriodicModelAverager(
        2
    )
    h = lsgd_jax.HierarchicalModelAverager({2: "local", 4: ("node", "local")}, offload_state=True)
    assert h.offload_state is True
