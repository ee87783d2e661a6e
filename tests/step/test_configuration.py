"""check_configuration: how the hook and the averagers of one chain fit together."""

import warnings

import jax.numpy as jnp
import optax
import pytest
from helpers import mesh_2x4

import lsgd_jax

GLOBAL = ("node", "local")


def chain(start, averager, allreduce=True, averager_first=False):
    hook = lsgd_jax.post_local_sgd(start, post_local_gradient_allreduce=allreduce)
    avg = lsgd_jax.model_averaging(averager)
    parts = [avg, hook, optax.sgd(0.1)] if averager_first else [hook, optax.sgd(0.1), avg]
    return optax.chain(*parts)


def warnings_of(opt_state):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lsgd_jax.check_configuration(opt_state)
    return [str(w.message) for w in caught]


def test_the_recommended_pairings_are_silent():
    for tx in (
        chain(8, lsgd_jax.PeriodicModelAverager(4, warmup_steps=8)),
        chain(0, lsgd_jax.PeriodicModelAverager(4)),
        chain(8, lsgd_jax.HierarchicalModelAverager({2: "local", 8: GLOBAL}, 8), allreduce=False),
        chain(8, lsgd_jax.HierarchicalModelAverager({2: "node", 8: GLOBAL}, 8)),
    ):
        assert warnings_of(tx.init({"w": jnp.zeros(3)})) == []


def test_an_averager_before_the_hook_is_an_error():
    tx = chain(8, lsgd_jax.PeriodicModelAverager(4, warmup_steps=8), averager_first=True)
    with pytest.raises(ValueError, match="comes before post_local_sgd.*Put post_local_sgd first"):
        lsgd_jax.check_configuration(tx.init({"w": jnp.zeros(3)}))
    with pytest.raises(ValueError, match="comes before post_local_sgd"):  # when built
        lsgd_jax.data_parallel_step(lambda p, b: jnp.mean((b @ p) ** 2), tx, mesh_2x4())


def test_a_warmup_that_differs_from_the_switch_names_both_numbers():
    tx = chain(8, lsgd_jax.PeriodicModelAverager(4, warmup_steps=5))
    (msg,) = warnings_of(tx.init({}))
    assert "warmup_steps=5" in msg and "start_localSGD_iter=8" in msg


def test_a_level_inside_the_hooks_subgroup_warns_once_per_step_build():
    tx = chain(8, lsgd_jax.HierarchicalModelAverager({2: "local", 8: GLOBAL}, 8))
    (msg,) = warnings_of(tx.init({}))
    assert "('local',)" in msg and "post_local_gradient_allreduce=False" in msg
    periodic = chain(8, lsgd_jax.PeriodicModelAverager(4, 8, process_group="local"))
    assert len(warnings_of(periodic.init({}))) == 1
    # Through data_parallel_step: one warning when the step is traced.
    mesh = mesh_2x4()
    step = lsgd_jax.data_parallel_step(lambda p, b: jnp.mean((b @ p) ** 2), tx, mesh)
    p, s = lsgd_jax.replicate(jnp.zeros(3), mesh), lsgd_jax.replicate(tx.init(jnp.zeros(3)), mesh)
    with pytest.warns(UserWarning, match="already identical"):
        step(p, s, jnp.ones((8, 3)))
