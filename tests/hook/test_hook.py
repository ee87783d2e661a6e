"""post_localSGD_hook and PostLocalSGDState: PyTorch's rules, types, logging, errors."""

import logging

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
    types_of,
    unsqueeze,
)
from jax.sharding import PartitionSpec as P

import lsgd_jax


def hook_fn(state, mesh, per_replica_state):
    """A jitted ``(state, grads) -> (state, grads)`` over per-replica grads."""
    if per_replica_state:

        def body(state, grads):
            g, s = lsgd_jax.post_localSGD_hook(squeeze(state), squeeze(grads))
            return unsqueeze(s), unsqueeze(g)

        return smap(body, mesh, (DATA, DATA), (DATA, DATA))

    def body(state, grads):
        g, s = lsgd_jax.post_localSGD_hook(state, squeeze(grads))
        return s, unsqueeze(g)

    return smap(body, mesh, (P(), DATA), (P(), DATA))


def place_state(state, mesh, per_replica_state):
    if per_replica_state:
        return put(jax.tree.map(lambda x: jnp.broadcast_to(x, (8,)), state), mesh, DATA)
    return put(state, mesh, P())


@pytest.mark.parametrize("per_replica_state", [False, True])
@pytest.mark.parametrize("post_local_gradient_allreduce", [True, False])
def test_global_then_local_means(per_replica_state, post_local_gradient_allreduce):
    mesh = mesh_2x4()
    start = 3
    state = lsgd_jax.PostLocalSGDState(
        None, None, start, post_local_gradient_allreduce=post_local_gradient_allreduce
    )
    f = hook_fn(state, mesh, per_replica_state)
    state = place_state(state, mesh, per_replica_state)
    key = jax.random.key(1)
    for step in range(7):
        grads = jax.random.normal(jax.random.fold_in(key, step), (8, 4, 3))
        state, out = f(state, put(grads, mesh, DATA))
        g = np.asarray(grads, np.float64)
        if step < start:
            want = group_means(g, 8)
        elif post_local_gradient_allreduce:
            want = group_means(g, 4)
        else:
            want = g
        np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
        if not post_local_gradient_allreduce and step >= start:
            np.testing.assert_array_equal(out, grads)  # untouched, bit for bit
        assert np.all(np.asarray(state.iter) == min(step + 1, start))  # stops at the start


def test_start_zero_is_local_from_the_first_step_and_never_counts():
    mesh = mesh_2x4()
    state = lsgd_jax.PostLocalSGDState(None, "local", 0)
    f = hook_fn(state, mesh, False)
    state = put(state, mesh, P())
    for _ in range(3):
        state, out = f(state, put(rank_values(8), mesh, DATA))
        np.testing.assert_allclose(out, group_means(np.asarray(rank_values(8)), 4))
    assert int(state.iter) == 0


def test_explicit_groups_and_every_leaf_kind():
    mesh = mesh_2x4()
    state = lsgd_jax.PostLocalSGDState(("local", "node"), ("local",), 1)
    f = hook_fn(state, mesh, False)
    grads = {
        "a": rank_values(8, (2,)),
        "b": [rank_values(8, (3, 1), jnp.bfloat16)],
        "n": jnp.arange(8, dtype=jnp.int32),  # not averaged
    }
    state, out = f(put(state, mesh, P()), put(grads, mesh, DATA))
    np.testing.assert_array_equal(out["a"], np.full((8, 2), 3.5))
    assert out["b"][0].dtype == jnp.bfloat16
    np.testing.assert_array_equal(out["b"][0].astype(jnp.float32), np.full((8, 3, 1), 3.5))
    np.testing.assert_array_equal(out["n"], np.arange(8))


def test_types_are_stable_and_the_hook_scans():
    mesh = mesh_2x4()
    state0 = lsgd_jax.PostLocalSGDState(None, None, 4)

    def body(state, grads):
        grads = squeeze(grads)
        before = types_of((grads, state))
        g, s = lsgd_jax.post_localSGD_hook(state, grads)
        assert types_of((g, s)) == before

        def scan_step(s, g):
            g, s = lsgd_jax.post_localSGD_hook(s, g)
            return s, g

        s, gs = jax.lax.scan(scan_step, s, jnp.stack([g] * 6))
        return s, gs[None]

    f = smap(body, mesh, (P(), DATA), (P(), DATA))
    state, outs = f(put(state0, mesh, P()), put(rank_values(8), mesh, DATA))
    assert int(state.iter) == 4
    assert state.iter.dtype == jnp.int32 and state.iter.shape == ()


def test_state_is_an_immutable_pytree_with_one_int32_leaf():
    state = lsgd_jax.PostLocalSGDState(("node", "local"), "local", 5, False)
    leaves, treedef = jax.tree.flatten(state)
    assert len(leaves) == 1 and leaves[0].dtype == jnp.int32 and leaves[0].shape == ()
    again = jax.tree.unflatten(treedef, leaves)
    assert again.start_localSGD_iter == 5 and again.subgroup == ("local",)
    assert again.process_group == ("node", "local") and not again.post_local_gradient_allreduce
    with pytest.raises(AttributeError, match="immutable"):
        state.iter = 3
    assert int(state.replace(iter=jnp.int32(7)).iter) == 7
    assert bool(state.replace(iter=jnp.int32(5)).local_sgd_started)
    with pytest.raises(TypeError, match="no field"):
        state.replace(step=1)


def test_iter_saturates():
    big = np.iinfo(np.int32).max
    state = lsgd_jax.PostLocalSGDState(None, None, 3).replace(iter=jnp.int32(big))
    assert int(state.maybe_increase_iter().iter) == big


# --- logging --------------------------------------------------------------------------


def test_logs_at_construction_and_once_at_the_switch(caplog):
    caplog.set_level(logging.INFO, logger="lsgd_jax")
    mesh = mesh_2x4()
    state = lsgd_jax.PostLocalSGDState(None, None, 2)
    assert [r.getMessage() for r in caplog.records] == [
        "Local SGD will be started after 2 iterations"
    ]
    caplog.clear()
    f = hook_fn(state, mesh, False)
    state = put(state, mesh, P())
    for _ in range(5):
        state, _ = f(state, put(rank_values(8), mesh, DATA))
    jax.effects_barrier()
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["Start to apply local SGD after 2 iterations."]  # once, not per device
    assert all(r.name == "lsgd_jax" for r in caplog.records)


def test_eager_maybe_increase_iter_logs_once(caplog):
    caplog.set_level(logging.INFO, logger="lsgd_jax")
    state = lsgd_jax.PostLocalSGDState(None, None, 2)
    caplog.clear()
    state = state.maybe_increase_iter()
    assert not caplog.records
    state = state.maybe_increase_iter()
    assert [r.getMessage() for r in caplog.records] == [
        "Start to apply local SGD after 2 iterations."
    ]


def test_tree_operations_do_not_log(caplog):
    state = lsgd_jax.PostLocalSGDState(None, None, 2)
    caplog.set_level(logging.INFO, logger="lsgd_jax")
    jax.tree.map(lambda x: x + 1, state)
    jax.jit(lambda s: s)(state)
    assert not caplog.records


# --- pmap -----------------------------------------------------------------------------


def test_under_pmap_with_index_groups():
    nodes = lsgd_jax.IndexGroups("batch", [[0, 1, 2, 3], [4, 5, 6, 7]])
    state = lsgd_jax.PostLocalSGDState(None, nodes, 2)

    def step(state, g):
        g, state = lsgd_jax.post_localSGD_hook(state, g)
        return state, g

    f = jax.pmap(step, axis_name="batch", in_axes=(None, 0), out_axes=(None, 0))
    g = rank_values(8)
    for i in range(4):
        state, out = f(state, g)
        want = group_means(np.asarray(g), 8 if i < 2 else 4)
        np.testing.assert_allclose(out, want)
    assert int(state.iter) == 2


# --- bad input ------------------------------------------------------------------------


def test_negative_start_is_rejected():
    with pytest.raises(ValueError, match="start_localSGD_iter must be a non-negative int, got -1"):
        lsgd_jax.PostLocalSGDState(None, None, -1)
    with pytest.raises(ValueError, match="start_localSGD_iter"):
        lsgd_jax.post_local_sgd(-2)
    with pytest.raises(TypeError, match="start_localSGD_iter must be a Python int"):
        lsgd_jax.post_local_sgd(1.5)


def test_bad_group_specs_are_rejected():
    with pytest.raises(ValueError, match="at least one mesh axis"):
        lsgd_jax.PostLocalSGDState((), None, 1)
    with pytest.raises(ValueError, match="names an axis twice"):
        lsgd_jax.PostLocalSGDState(None, ("local", "local"), 1)
    with pytest.raises(ValueError, match="partition"):
        lsgd_jax.IndexGroups("i", [[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="same size"):
        lsgd_jax.IndexGroups("i", [[0, 1, 2], [3]])
    with pytest.raises(TypeError, match="True or False"):
        lsgd_jax.PostLocalSGDState(None, None, 1, post_local_gradient_allreduce=1)


def test_unbound_subgroup_axis_is_named():
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("host", "chip"))
    state = lsgd_jax.PostLocalSGDState(None, None, 1)

    def body(state, g):
        g, state = lsgd_jax.post_localSGD_hook(state, g[0])
        return state, g[None]

    f = smap(body, mesh, (P(), P(("host", "chip"))), (P(), P(("host", "chip"))))
    with pytest.raises(lsgd_jax.AxisNotBoundError, match="'local' is not bound here") as e:
        f(state, jnp.ones(8))
    assert "('host', 'chip')" in str(e.value) and "subgroup" in str(e.value)


def test_hook_rejects_a_wrong_state():
    with pytest.raises(TypeError, match="expects a PostLocalSGDState"):
        lsgd_jax.post_localSGD_hook({"iter": 0}, jnp.ones(3))


@pytest.mark.parametrize("process_group", [None, ("node", "local")])
def test_outside_any_mapping_one_message_says_what_to_do(process_group):
    # It used to say "pass the axis names explicitly", and with them passed, that the
    # axis is not bound: two messages, neither with the fix.
    state = lsgd_jax.PostLocalSGDState(process_group, "local", start_localSGD_iter=1)
    with pytest.raises(lsgd_jax.AxisNotBoundError) as e:
        jax.jit(lsgd_jax.post_localSGD_hook)(state, jnp.ones(3))
    msg = str(e.value)
    assert "no mapped axis is bound here" in msg and "data_parallel_step" in msg
    assert "jax.shard_map" in msg and "pass the axis names" not in msg


def test_make_mesh_axes_are_auto_so_plain_jit_code_runs_on_it():
    mesh = lsgd_jax.make_mesh(2, 4)
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2
    # A plain-jit DDP baseline: the compiler shards the batch, no shard_map.
    x = jax.device_put(jnp.ones((16, 3)), jax.NamedSharding(mesh, P(("node", "local"))))
    w = jax.device_put(jnp.zeros(3), jax.NamedSharding(mesh, P()))
    grad = jax.jit(jax.grad(lambda w, x: jnp.mean((x @ w - 1.0) ** 2)))(w, x)
    np.testing.assert_allclose(grad, -2.0 * np.ones(3))


# --- error feedback (comm.quantized): the residual in the state ----------------------------


def test_without_error_feedback_the_state_keeps_its_one_child_structure():
    # Checkpoints saved before the hook could keep a residual hold this structure.
    state = lsgd_jax.PostLocalSGDState(None, "local", 3).init({"w": jnp.ones(4)})
    assert state.comm_state is None
    assert str(jax.tree.structure(state)) == (
        "PyTreeDef(CustomNode(PostLocalSGDState[(None, ('local',), 3, True, None, None)], [*]))"
    )
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    assert paths == [".iter"]
    with_ef = lsgd_jax.PostLocalSGDState(
        None, "local", 3, communication=lsgd_jax.comm.quantized(8)
    ).init({"w": jnp.ones(4)})
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(with_ef)[0]]
    assert paths == [".iter", ".comm_state['w']"]
    assert jax.tree.structure(with_ef.replace(comm_state=None)) != jax.tree.structure(with_ef)


def test_under_pmap_error_feedback_telescopes_across_the_switch():
    nodes = lsgd_jax.IndexGroups("batch", [[0, 1, 2, 3], [4, 5, 6, 7]])
    grads0 = jnp.zeros(1024)
    state = lsgd_jax.PostLocalSGDState(
        None, nodes, 2, communication=lsgd_jax.comm.quantized(4)
    ).init(grads0)

    def step(state, g):
        g, state = lsgd_jax.post_localSGD_hook(state, g)
        return state, g

    f = jax.pmap(step, axis_name="batch")
    state = jax.tree.map(lambda x: jnp.broadcast_to(x, (8, *jnp.shape(x))), state)
    rng = np.random.default_rng(0)
    sent, true = np.zeros(1024), np.zeros(1024)
    for i in range(4):
        g = (rng.normal(size=(8, 1024)) * 10.0 ** rng.uniform(-2, 2, (1, 1024))).astype(np.float32)
        state, out = f(state, jnp.asarray(g))
        out = np.asarray(out, np.float64)
        size = 8 if i < 2 else 4  # global, then inside each node of 4
        groups = out.reshape(8 // size, size, -1)
        assert (groups == groups[:, :1]).all()
        sent, true = sent + out.sum(0), true + g.astype(np.float64).sum(0)
    residual = np.asarray(state.comm_state, np.float64).sum(0)
    assert np.abs(residual).max() > 0
    np.testing.assert_allclose(sent + residual, true, rtol=1e-5, atol=1e-4)
    assert np.abs(sent - true).max() > 1e-2  # quantized: the residual closes the gap
