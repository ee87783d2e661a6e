"""Checkpoints (one process, 8 devices): exact resume, the sync check, and the errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh_2x4, state_for, types_of
from mp_worker import CFG, fresh_state, global_batch, init_params, loss_fn, make_tx, train

import lsgd_jax


def hierarchical_tx():
    return optax.chain(
        lsgd_jax.post_local_sgd(CFG["start"], post_local_gradient_allreduce=False),
        lsgd_jax.post_local_sgd_optimizer(
            optax.adam(0.01),
            lsgd_jax.HierarchicalModelAverager({2: "local", 4: ("node", "local")}, CFG["start"]),
        ),
    )


TXS = {"periodic": make_tx, "hierarchical": hierarchical_tx}


def assert_trees_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        assert g.sharding == w.sharding, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(g, w, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("kind", TXS)
def test_resume_before_the_switch_and_inside_a_local_period_is_bitwise_identical(kind, tmp_path):
    mesh = mesh_2x4()
    make = TXS[kind]
    saves = {2: None, 6: None}  # switch at 4; periodic averages at 4, 7, 10; hierarchical 4, 6, 8

    def on_step(s, state):
        if s + 1 in saves:
            lsgd_jax.save_checkpoint(tmp_path, s + 1, state)

    step = lsgd_jax.data_parallel_step(loss_fn, make(), mesh)
    want = train(state_for(make(), mesh), step, 0, CFG["steps"], global_batch, on_step)
    assert lsgd_jax.latest_checkpoint_step(tmp_path) == 6
    for k in saves:
        tx = make()  # a new process would rebuild everything
        target = state_for(tx, mesh)
        state = lsgd_jax.restore_checkpoint(tmp_path, target, step=k)
        counters = lsgd_jax.assert_replicas_in_sync(state)
        assert counters["['opt_state'][0].iter"] == min(k, CFG["start"])
        step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh)
        got = train(state, step, k, CFG["steps"], global_batch)
        assert_trees_equal(got, want)


def test_restored_state_keeps_types_shardings_and_static_metadata(tmp_path):
    mesh = mesh_2x4()
    tx = hierarchical_tx()
    state = state_for(tx, mesh)
    state["host_step"] = 5  # host values round-trip as numpy
    lsgd_jax.save_checkpoint(tmp_path, 0, state)
    restored = lsgd_jax.restore_checkpoint(tmp_path, state)
    assert int(restored.pop("host_step")) == 5
    del state["host_step"]
    assert types_of(restored) == types_of(state)
    assert_trees_equal(restored, state)
    hook, opt = restored["opt_state"]
    assert hook.start_localSGD_iter == CFG["start"] and not hook.post_local_gradient_allreduce
    assert opt.averager_state.averager.periods == (2, 4)
    # Unreplicated state (one device) restores too.
    plain = {"opt_state": tx.init(init_params())}
    lsgd_jax.save_checkpoint(tmp_path / "plain", 3, plain)
    back = lsgd_jax.restore_checkpoint(tmp_path / "plain", plain)
    assert jax.tree.structure(back) == jax.tree.structure(plain)


def test_assert_replicas_in_sync_names_the_disagreeing_values():
    mesh = mesh_2x4()
    state = fresh_state(mesh)
    assert lsgd_jax.assert_replicas_in_sync(state, host_counters={"data position": 3}) == {
        "['opt_state'][0].iter": 0,
        "['opt_state'][2].step": 0,
        "data position": 3,
    }
    hook, sgd, avg = state["opt_state"]
    bad = {
        "params": state["params"],
        "opt_state": (hook.replace(iter=hook.iter.at[5].set(3)), sgd, avg),
    }
    with pytest.raises(lsgd_jax.ReplicasOutOfSyncError) as err:
        lsgd_jax.assert_replicas_in_sync(bad)
    msg = str(err.value)
    assert "['opt_state'][0].iter is 0 on replicas 0-4,6-7 (process 0); 3 on replica 5" in msg
    assert "deadlocks" in msg and "same checkpoint step" in msg
    assert err.value.values == {
        "['opt_state'][0].iter": {0: ["replicas 0-4,6-7 (process 0)"], 3: ["replica 5 (process 0)"]}
    }
    # Host arrays and Python ints count too (e.g. a state fetched with jax.device_get).
    host = jax.device_get(bad)
    with pytest.raises(lsgd_jax.ReplicasOutOfSyncError, match="3 on replica 5"):
        lsgd_jax.assert_replicas_in_sync(host)
    assert lsgd_jax.assert_replicas_in_sync({"params": state["params"]}) == {}


def test_data_parallel_step_can_check_the_counters_before_it_runs():
    mesh = mesh_2x4()
    tx = make_tx()
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, check_in_sync_every=2)

    def out_of_sync():
        hook, sgd, avg = fresh_state(mesh)["opt_state"]
        return (hook, sgd, avg.replace(step=avg.step.at[0].set(1)))

    state = fresh_state(mesh)
    with pytest.raises(lsgd_jax.ReplicasOutOfSyncError, match=r"\[2\]\.step is 0 on replicas 1-7"):
        step(state["params"], out_of_sync(), global_batch(0))  # the first call checks
    params, opt_state, _ = step(state["params"], state["opt_state"], global_batch(0))
    params, opt_state, _ = step(params, opt_state, global_batch(1))
    with pytest.raises(lsgd_jax.ReplicasOutOfSyncError, match="1 on replica 0"):
        step(params, out_of_sync(), global_batch(2))  # and every second call after it
    with pytest.raises(ValueError, match="check_in_sync_every must be a positive int"):
        lsgd_jax.data_parallel_step(loss_fn, tx, mesh, check_in_sync_every=0)


def test_checkpoint_errors_say_what_to_fix(tmp_path):
    mesh = mesh_2x4()
    state = fresh_state(mesh)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        lsgd_jax.restore_checkpoint(tmp_path, state)
    assert lsgd_jax.latest_checkpoint_step(tmp_path / "missing") is None
    lsgd_jax.save_checkpoint(tmp_path, 4, state, max_to_keep=2)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint of step 3 .*saved steps: \[4\]"):
        lsgd_jax.restore_checkpoint(tmp_path, state, step=3)
    small = fresh_state(lsgd_jax.make_mesh(2, 2))  # 4 replicas, not 8
    with pytest.raises(ValueError, match=r"was saved as int32\[8\] but the target is int32\[4\]"):
        lsgd_jax.restore_checkpoint(tmp_path, small)
    with pytest.raises(
        ValueError, match=r"holds 8 leaves, the target 9.*not saved: \[\"\['extra'\]\"\]"
    ):
        lsgd_jax.restore_checkpoint(tmp_path, {**state, "extra": jnp.zeros(2)})
    other = dict(state)
    other["opt_state"] = lsgd_jax.replicate(
        optax.chain(
            lsgd_jax.post_local_sgd(CFG["start"]),
            optax.sgd(CFG["lr"], momentum=CFG["momentum"]),
            lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(5, CFG["start"])),
        ).init(init_params()),
        mesh,
    )
    with pytest.warns(UserWarning, match="names or static metadata only"):
        back = lsgd_jax.restore_checkpoint(tmp_path, other)
    assert back["opt_state"][2].averager.period == 5  # the target's metadata wins
    with pytest.raises(TypeError, match=r"leaf \['fn'\] is a function"):
        lsgd_jax.save_checkpoint(tmp_path, 5, {"fn": lambda: 0})
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        lsgd_jax.save_checkpoint(tmp_path, -1, state)
    for s in (5, 6):  # max_to_keep=2 keeps the newest two
        lsgd_jax.save_checkpoint(tmp_path, s, state, max_to_keep=2)
    assert lsgd_jax.latest_checkpoint_step(tmp_path) == 6
    with pytest.raises(FileNotFoundError, match=r"saved steps: \[5, 6\]"):
        lsgd_jax.restore_checkpoint(tmp_path, state, step=4)


def test_the_checkpoint_format_is_written_in_one_place():
    """save_checkpoint and the elastic loop's writer both build a step with
    checkpoint/_format.py: nothing else writes an orbax item or a manifest (issue 28)."""
    import pathlib

    root = pathlib.Path(lsgd_jax.__file__).parent
    writers = {
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        for marker in ("JsonSave(", "StandardSave(", '"skeleton":', "CheckpointManager(")
        if marker in path.read_text()
    }
    assert writers == {"checkpoint/_format.py"}
