"""Restoring a checkpoint of N replicas onto M (one process, 8 devices).

Every leaf of the restored state is checked against a NumPy computation of the rule on
the saved arrays: floating leaves are the mean over the saved replicas (exactly the
saved value where every replica held the same one), integer leaves are copied and must
have agreed, ``skipped`` is whether any replica skipped. Then training goes on.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from mp_worker import global_batch, init_params, loss_fn

import lsgd_jax

# the slow tier: 50 s on 2 workers (2026-12-01)
pytestmark = pytest.mark.slow

START, PERIOD = 2, 3  # global averages at steps 2, 5, 8, ...


def make_tx(kind):
    """The chains under test: DiLoCo (an outer optimizer), 4-bit two-level means with
    error feedback, and a delay of 2 (an average lands two calls after it starts)."""
    options = {
        "diloco": {"outer_optimizer": optax.sgd(0.7, momentum=0.9)},
        "quantized": {"communication": lsgd_jax.comm.quantized(4, two_level=True)},
        "delayed": {"delay": 2},
    }[kind]
    return optax.chain(
        lsgd_jax.post_local_sgd(START),
        optax.sgd(0.05, momentum=0.9),
        lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(PERIOD, START, **options)),
    )


# Saved after this many steps, inside a local period so that the replicas differ: two
# global averages done (diloco: outer momentum); the residuals of the average at step 5
# (quantized); the average started at step 5 in flight (delayed: it lands at step 7).
SAVE_AT = {"diloco": 7, "quantized": 7, "delayed": 6}

MESHES = {8: (2, 4), 4: (2, 2), 2: (1, 2)}


def mesh_of(n):
    return lsgd_jax.make_mesh(*MESHES[n])


def fresh(tx, mesh):
    p0 = init_params()
    return {
        "params": lsgd_jax.replicate(p0, mesh),
        "opt_state": lsgd_jax.replicate(tx.init(p0), mesh),
    }


@functools.cache  # saved, never changed: shared by the tests that restore it
def trained(kind, n, steps):
    tx = make_tx(kind)
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh_of(n))
    params, opt_state = fresh(tx, mesh_of(n)).values()
    for s in range(steps):
        params, opt_state, _ = step(params, opt_state, global_batch(s))
    return {"params": params, "opt_state": opt_state}


def averager_state(state):
    return state["opt_state"][2]


def expected(saved, path):
    """The rule, in NumPy, on one saved leaf (leading axis: the saved replicas)."""
    x = np.asarray(saved)
    if path.endswith(".skipped"):
        return x.any(axis=0)
    if not np.issubdtype(x.dtype, np.inexact):
        assert (x == x[:1]).all(), path  # counters agree
        return x[0]
    mean = x.astype(np.float64).mean(axis=0).astype(x.dtype)
    return np.where((x == x[:1]).all(axis=0), x[0], mean)


def assert_rule(saved, restored, m):
    """Every leaf of ``restored`` holds the rule's value on each of its ``m`` replicas."""
    flat_saved = jax.tree_util.tree_flatten_with_path(jax.device_get(saved))[0]
    flat_restored = jax.tree.leaves(jax.device_get(restored))
    assert len(flat_saved) == len(flat_restored)
    for (path, s), r in zip(flat_saved, flat_restored, strict=True):
        name = jax.tree_util.keystr(path)
        r = np.asarray(r)
        assert r.shape == (m, *np.shape(s)[1:]) and r.dtype == np.asarray(s).dtype, name
        want = expected(s, name)
        for j in range(m):  # every new replica holds the same value, bitwise
            np.testing.assert_array_equal(r[j], r[0], err_msg=name)
        if np.issubdtype(r.dtype, np.inexact):
            np.testing.assert_allclose(r[0], want, rtol=2e-6, atol=1e-7, err_msg=name)
            same = (np.asarray(s) == np.asarray(s)[:1]).all(axis=0)
            np.testing.assert_array_equal(r[0][same], want[same], err_msg=name)
        else:
            np.testing.assert_array_equal(r[0], want, err_msg=name)


def assert_differs_across_replicas(x, what):
    x = np.asarray(x)
    assert not (x == x[:1]).all(), f"{what} is the same on every saved replica"


def continue_training(tx, state, m, first, steps=4):
    """A few more steps on ``m`` replicas (``tx``: the target's): finite losses, and
    counters that advance."""
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh_of(m))
    params, opt_state = state["params"], state["opt_state"]
    before = lsgd_jax.assert_replicas_in_sync(opt_state)
    for s in range(first, first + steps):
        params, opt_state, loss = step(params, opt_state, global_batch(s))
        assert np.isfinite(np.asarray(loss)).all()
    after = lsgd_jax.assert_replicas_in_sync(opt_state)
    counter = next(k for k in after if k.endswith(".step"))  # the averager's
    assert after[counter] == before[counter] + steps
    return params, opt_state


@pytest.mark.parametrize("kind", list(SAVE_AT))
@pytest.mark.parametrize("n, m", [(8, 4), (8, 2), (4, 8)])
def test_a_checkpoint_of_n_replicas_restores_on_m_by_the_rule(kind, n, m, tmp_path):
    k = SAVE_AT[kind]
    saved = trained(kind, n, k)
    lsgd_jax.save_checkpoint(tmp_path, k, saved)
    tx = make_tx(kind)
    target = fresh(tx, mesh_of(m))
    restored = lsgd_jax.restore_checkpoint(tmp_path, target, step=k, resize=True, strict=True)
    assert_rule(saved, restored, m)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True):
        assert got.sharding == want.sharding
    avg = averager_state(saved)
    assert_differs_across_replicas(saved["params"]["w1"], "params")
    assert_differs_across_replicas(saved["opt_state"][1][0].trace["w1"], "momentum")
    if kind == "diloco":  # the anchor and outer momentum are common: restored exactly
        assert np.abs(np.asarray(avg.outer_state[0].trace["w1"])).max() > 0
        for leaf in ("anchor", "outer_state"):
            got, want = getattr(averager_state(restored), leaf), getattr(avg, leaf)
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                np.testing.assert_array_equal(np.asarray(g)[0], np.asarray(w)[0])
    if kind == "quantized":  # each replica's residual is its own rounding: their mean
        assert_differs_across_replicas(avg.comm_state["w1"], "the residual")
    if kind == "delayed":  # in flight: a common mean, and each replica's start
        assert_differs_across_replicas(avg.inflight_start["w1"], "inflight_start")
        got = np.asarray(averager_state(restored).inflight_mean["w1"])
        np.testing.assert_array_equal(got[0], np.asarray(avg.inflight_mean["w1"])[0])
    continue_training(tx, restored, m, k)


def test_the_restored_run_goes_on_like_the_consensus_of_the_saved_one(tmp_path):
    # The rule is linear where it averages, so it commutes with a delayed average's
    # landing: after one more step at the same gradients, the new replicas' landing
    # equals the mean of the saved replicas' landings, params + (mean - start).
    kind, k = "delayed", 6
    saved = trained(kind, 8, k)
    lsgd_jax.save_checkpoint(tmp_path, k, saved)
    tx = make_tx(kind)
    restored = lsgd_jax.restore_checkpoint(tmp_path, fresh(tx, mesh_of(4)), resize=True)
    avg, new = averager_state(saved), averager_state(restored)
    for name in ("w1", "b1", "w2"):
        landed_then = np.asarray(saved["params"][name]) + (
            np.asarray(avg.inflight_mean[name]) - np.asarray(avg.inflight_start[name])
        )
        landed_now = np.asarray(restored["params"][name]) + (
            np.asarray(new.inflight_mean[name]) - np.asarray(new.inflight_start[name])
        )
        np.testing.assert_allclose(landed_now[0], landed_then.mean(0), rtol=1e-5, atol=1e-6)
    params, _ = continue_training(tx, restored, 4, k, steps=PERIOD + 2)
    assert np.isfinite(np.asarray(params["w1"])).all()


@pytest.mark.parametrize("kind", ["diloco", "delayed"])
def test_resize_onto_as_many_replicas_is_the_plain_restore_bitwise(kind, tmp_path):
    saved = trained(kind, 8, SAVE_AT[kind])
    lsgd_jax.save_checkpoint(tmp_path, 1, saved)
    target = fresh(make_tx(kind), mesh_of(8))
    plain = lsgd_jax.restore_checkpoint(tmp_path, target)
    resized = lsgd_jax.restore_checkpoint(tmp_path, target, resize=True)
    assert jax.tree.structure(resized) == jax.tree.structure(plain)
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(resized)[0], jax.tree.leaves(plain), strict=True
    ):
        assert a.sharding == b.sharding, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), jax.tree_util.keystr(path))


def test_counters_that_differ_across_the_saved_replicas_are_an_error(tmp_path):
    state = fresh(make_tx("diloco"), mesh_of(8))
    hook, sgd, avg = state["opt_state"]
    state["opt_state"] = (hook.replace(iter=hook.iter.at[5].set(3)), sgd, avg)
    lsgd_jax.save_checkpoint(tmp_path, 0, state)
    with pytest.raises(lsgd_jax.ReplicasOutOfSyncError) as err:
        lsgd_jax.restore_checkpoint(tmp_path, fresh(make_tx("diloco"), mesh_of(4)), resize=True)
    msg = str(err.value)
    assert "checkpoint 0 disagree" in msg
    assert "['opt_state'][0].iter: 0 on replicas 0-4,6-7; 3 on replica 5" in msg
    assert err.value.values == {
        "['opt_state'][0].iter": {0: ["replicas 0-4,6-7"], 3: ["replica 5"]}
    }


def test_a_target_that_differs_beyond_the_replica_count_is_an_error(tmp_path):
    tx = make_tx("diloco")
    lsgd_jax.save_checkpoint(tmp_path, 0, fresh(tx, mesh_of(8)))
    other = fresh(tx, mesh_of(4))
    wider = {k: np.zeros((7, *v.shape[1:]), v.dtype) for k, v in init_params().items()}
    other["params"] = lsgd_jax.replicate(wider, mesh_of(4))
    with pytest.raises(
        ValueError,
        match=r"leaf \['params'\]\['b1'\] was saved as float32\[8, 8\] "
        r"but the target is float32\[4, 7\]: they differ beyond the leading",
    ):
        lsgd_jax.restore_checkpoint(tmp_path, other, resize=True)
    mixed = {
        "params": fresh(tx, mesh_of(4))["params"],
        "opt_state": fresh(tx, mesh_of(2))["opt_state"],
    }
    with pytest.raises(ValueError, match=r"in more than one way \(8 -> 2: .*; 8 -> 4: "):
        lsgd_jax.restore_checkpoint(tmp_path, mixed, resize=True)
    with pytest.raises(ValueError, match=r"holds 15 leaves, the target 16"):
        lsgd_jax.restore_checkpoint(
            tmp_path, {**fresh(tx, mesh_of(4)), "extra": np.zeros(2)}, resize=True
        )
    with pytest.raises(ValueError, match=r"saved as .*\[8\] .*or pass resize=True"):
        lsgd_jax.restore_checkpoint(tmp_path, fresh(tx, mesh_of(4)))


def test_host_leaves_resize_too(tmp_path):
    saved = {
        "w": np.arange(8.0, dtype=np.float32)[:, None] * np.ones((8, 2), np.float32),
        "count": np.full(8, 3, np.int32),
        "global": np.arange(5),
    }
    lsgd_jax.save_checkpoint(tmp_path, 0, saved)
    target = {
        "w": np.zeros((3, 2), np.float32),
        "count": np.zeros(3, np.int32),
        "global": np.zeros(5, np.int64),
    }
    back = lsgd_jax.restore_checkpoint(tmp_path, target, resize=True)
    np.testing.assert_array_equal(back["w"], np.full((3, 2), 3.5, np.float32))
    np.testing.assert_array_equal(back["count"], [3, 3, 3])
    np.testing.assert_array_equal(back["global"], np.arange(5))  # same shape: as saved


def test_adam_moments_and_model_state_resize_and_adams_count_is_copied(tmp_path):
    # post_local_sgd_optimizer(adam): mu and nu per replica (their mean), Adam's integer
    # count (copied); a per-replica model state (batch-norm statistics: their mean).
    tx = optax.chain(
        lsgd_jax.post_local_sgd(START, post_local_gradient_allreduce=False),
        lsgd_jax.post_local_sgd_optimizer(
            optax.adam(0.01), lsgd_jax.PeriodicModelAverager(PERIOD, START)
        ),
    )
    mesh = mesh_of(8)
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh)
    params, opt_state = fresh(tx, mesh).values()
    for s in range(4):
        params, opt_state, _ = step(params, opt_state, global_batch(s))
    stats = lsgd_jax.replicate({"mean": np.zeros(3, np.float32)}, mesh)
    stats = {"mean": stats["mean"] + np.arange(8.0, dtype=np.float32)[:, None]}
    saved = {"params": params, "opt_state": opt_state, "model_state": stats}
    lsgd_jax.save_checkpoint(tmp_path, 4, saved)
    target = {
        **fresh(tx, mesh_of(4)),
        "model_state": lsgd_jax.replicate({"mean": np.zeros(3, np.float32)}, mesh_of(4)),
    }
    restored = lsgd_jax.restore_checkpoint(tmp_path, target, resize=True, strict=True)
    assert_rule(saved, restored, 4)
    adam = saved["opt_state"][1].inner_state[0]
    assert_differs_across_replicas(adam.mu["w1"], "Adam's mu")
    assert_differs_across_replicas(adam.nu["w1"], "Adam's nu")
    count = np.asarray(restored["opt_state"][1].inner_state[0].count)
    np.testing.assert_array_equal(count, [4] * 4)
    np.testing.assert_array_equal(np.asarray(restored["model_state"]["mean"]), 3.5)
    continue_training(tx, restored, 4, 4)


def test_per_replica_integers_that_differ_are_named_by_element(tmp_path):
    keys = np.array([[0, 1], [0, 2], [0, 1], [0, 1]], np.uint32)  # e.g. PRNG keys
    lsgd_jax.save_checkpoint(tmp_path, 0, {"key": keys})
    with pytest.raises(lsgd_jax.ReplicasOutOfSyncError) as err:
        lsgd_jax.restore_checkpoint(tmp_path, {"key": np.zeros((2, 2), np.uint32)}, resize=True)
    assert "['key'] (element 1 of each replica's): 1 on replicas 0,2-3; 2 on replica 1" in str(
        err.value
    )
    assert "PRNG keys" in str(err.value) and "without resize=True" in str(err.value)
    back = lsgd_jax.restore_checkpoint(tmp_path, {"key": np.zeros((4, 2), np.uint32)})
    np.testing.assert_array_equal(back["key"], keys)  # as many replicas: as saved
