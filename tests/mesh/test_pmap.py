"""The same transforms under jax.pmap: one axis, node groups as axis_index_groups."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import DATA, mesh_2x4, put, smap, squeeze, unsqueeze

import lsgd_jax


def loss(params, x):
    return jnp.mean(jnp.tanh(x @ params["w"] + params["b"]) ** 2)


def make_tx(subgroup, averager_group):
    return optax.chain(
        lsgd_jax.post_local_sgd(3, subgroup=subgroup),
        optax.sgd(0.1, momentum=0.9),
        lsgd_jax.model_averaging(
            lsgd_jax.HierarchicalModelAverager({2: averager_group, 4: None}, warmup_steps=3)
        ),
    )


def init():
    k = jax.random.key(0)
    return {"w": jax.random.normal(k, (6, 4)), "b": jnp.zeros(4)}


def data(s):
    return jax.random.normal(jax.random.key(10 + s), (8, 5, 6))


def test_pmap_matches_shard_map():
    # pmap: one axis "batch", nodes of 4 consecutive indices as IndexGroups.
    nodes = lsgd_jax.node_groups("batch", devices_per_node=4)
    tx_p = make_tx(nodes, nodes)

    def pstep(params, opt_state, x):
        g = jax.grad(loss)(params, x)
        u, opt_state = tx_p.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state

    pstep = jax.pmap(pstep, axis_name="batch")
    params_p = jax.tree.map(lambda x: jnp.stack([x] * 8), init())
    state_p = jax.tree.map(lambda x: jnp.stack([x] * 8), tx_p.init(init()))

    # shard_map over a (2, 4) mesh with named axes.
    mesh = mesh_2x4()
    tx_s = make_tx("local", "local")

    def sbody(params, opt_state, x):
        params, opt_state = squeeze(params), squeeze(opt_state)
        g = jax.grad(loss)(params, x[0])
        u, opt_state = tx_s.update(g, opt_state, params)
        return unsqueeze(optax.apply_updates(params, u)), unsqueeze(opt_state)

    sstep = smap(sbody, mesh, (DATA, DATA, DATA), (DATA, DATA))
    params_s = lsgd_jax.replicate(init(), mesh)
    state_s = lsgd_jax.replicate(tx_s.init(init()), mesh)

    for s in range(10):
        params_p, state_p = pstep(params_p, state_p, data(s))
        params_s, state_s = sstep(params_s, state_s, put(data(s), mesh, DATA))
        for a, b in zip(jax.tree.leaves(params_p), jax.tree.leaves(params_s)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # nodes differ at step 9 (after the switch, not an averaging step): not a vacuous test
    assert not np.allclose(params_p["w"][0], params_p["w"][4])


def test_pmap_default_subgroup_follows_the_process_layout():
    groups = lsgd_jax.node_groups("batch")
    assert groups.groups == (tuple(range(8)),)  # one process: one node
    state = lsgd_jax.PostLocalSGDState(None, None, 0)  # local from the start

    def f(g):
        g, _ = lsgd_jax.post_localSGD_hook(state, g)
        return g

    out = jax.pmap(f, axis_name="batch")(jnp.arange(8.0))
    np.testing.assert_allclose(out, np.full(8, 3.5))  # the "node" is all 8 devices


def test_mesh_style_axis_under_pmap_is_explained():
    state = lsgd_jax.PostLocalSGDState(None, ("local",), 1)

    def f(g):
        return lsgd_jax.post_localSGD_hook(state, g)[0]

    with pytest.raises(lsgd_jax.AxisNotBoundError, match=r"node_groups\('batch'"):
        jax.pmap(f, axis_name="batch")(jnp.arange(8.0))


def test_index_groups_under_checked_shard_map_is_explained():
    mesh = mesh_2x4()
    state = lsgd_jax.PostLocalSGDState(None, lsgd_jax.IndexGroups("local", [[0, 1], [2, 3]]), 0)

    def body(g):
        return unsqueeze(lsgd_jax.post_localSGD_hook(state, squeeze(g))[0])

    with pytest.raises(NotImplementedError, match="check_vma=False"):
        smap(body, mesh, DATA, DATA)(put(jnp.arange(8.0), mesh, DATA))
    out = smap(body, mesh, DATA, DATA, check_vma=False)(put(jnp.arange(8.0), mesh, DATA))
    np.testing.assert_allclose(out, [0.5, 0.5, 2.5, 2.5, 4.5, 4.5, 6.5, 6.5])


def test_node_groups_validation():
    with pytest.raises(ValueError, match="positive divisor of the 8 devices"):
        lsgd_jax.node_groups("i", devices_per_node=3)
