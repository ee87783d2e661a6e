"""lsgd_jax.elastic._start: what ElasticLoop checks before it runs (step options, the
watchdog against initialize()'s timeouts, model state and aux, FSDP over the local axis),
and the state a run starts from, checked part by part and shard by shard."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from lsgd_jax.elastic import ElasticLoop, _records, _start

AXES = ("node", "local")


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"]) ** 2)


def test_the_loop_refuses_options_a_retry_cannot_have():
    with pytest.raises(ValueError, match=r"\['donate'\]"):
        ElasticLoop(lambda p, b: 0.0, None, {}, None, step_options={"donate": True})


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"stall_timeout_s": 0}, ValueError, "stall_timeout_s must be a positive number"),
        ({"stall_timeout_s": -5.0}, ValueError, "stall_timeout_s.*got -5.0"),
        ({"stall_timeout_s": float("nan")}, ValueError, "stall_timeout_s.*got nan"),
        ({"stall_timeout_s": "60"}, TypeError, "stall_timeout_s.*got '60'"),
        ({"max_failures": 0}, ValueError, "max_failures"),
        ({"step_options": {"bogus": 1}}, ValueError, r"unknown.*\['bogus'\].*specialize"),
        ({"step_options": {"specialize": "never"}}, ValueError, "specialize.*'never'"),
        ({"step_options": {"max_in_flight": 0}}, ValueError, "max_in_flight"),
    ],
)
def test_the_loop_refuses_bad_timeouts_and_step_options(kwargs, error, match):
    # Refused in the constructor, before it needs jax.distributed (not initialized here).
    tx = optax.sgd(0.1)
    with pytest.raises(error, match=match):
        ElasticLoop(_loss, tx, {"w": np.zeros((3, 1), np.float32)}, lambda s, lay: {}, **kwargs)


def test_a_watchdog_shorter_than_a_wait_for_a_dead_peer_is_refused(monkeypatch):
    """stall_timeout_s must outlast collective_timeout_s + heartbeat_timeout_s (what
    initialize() set): else a survivor blocked in a collective on a dead peer would be
    ended by its own watchdog. One process has no peer to wait for."""
    tx, params = optax.sgd(0.1), {"w": np.zeros((3, 1), np.float32)}

    def build(stall):
        return ElasticLoop(_loss, tx, params, lambda s, lay: {}, stall_timeout_s=stall)

    timeouts = {"heartbeat": 3, "collective": 5, "processes": 3}
    monkeypatch.setattr(_start, "_TIMEOUTS", timeouts)
    for stall in (2.0, 8):
        with pytest.raises(ValueError, match=rf"stall_timeout_s={stall:g} s .*\(8 s\)"):
            build(stall)
    for stall in (8.5, None):  # accepted: the next check wants jax.distributed
        with pytest.raises(RuntimeError, match="jax.distributed is not initialized"):
            build(stall)
    monkeypatch.setattr(_start, "_TIMEOUTS", {**timeouts, "processes": 1})
    with pytest.raises(RuntimeError, match="jax.distributed is not initialized"):
        build(2.0)


# Model state and aux in the loop (issue 19 item 4).


def _ms_loss(params, model_state, batch):
    mean = 0.9 * model_state["mean"] + 0.1 * batch["x"].mean(0)
    loss = jnp.mean(((batch["x"] - mean) @ params["w"]) ** 2)
    return loss, ({"mean": mean}, {"n": jnp.int32(batch["x"].shape[0])})


_MS_INIT = {"mean": np.zeros(3, np.float32)}


def test_the_loop_takes_model_state_and_aux_in_its_step_options():
    # No longer refused: checked (the step built once on one device) and accepted.

    options = {"with_model_state": True, "has_aux": True}
    tx = optax.sgd(0.1)
    assert _start._check_loop_args(_ms_loss, tx, options, None, 3, _MS_INIT) == (None, 3)
    assert _start._check_loop_args(_loss, tx, {"has_aux": False}, None, 3) == (None, 3)


@pytest.mark.parametrize(
    "options,init_model_state,match",
    [
        ({"with_model_state": True}, None, r"with_model_state.*needs init_model_state="),
        ({}, _MS_INIT, "init_model_state was given, but the step takes no model state"),
        ({"has_aux": True}, _MS_INIT, "init_model_state was given"),
        ({"with_model_state": "yes"}, _MS_INIT, "'with_model_state' must be True.*'yes'"),
        ({"has_aux": 1}, None, "'has_aux' must be True or False, got 1"),
        ({"axes": ("node",)}, None, r"\['axes'\] cannot be set"),
    ],
)
def test_the_loop_refuses_model_state_without_its_option_and_the_reverse(
    options, init_model_state, match
):
    with pytest.raises(ValueError, match=match):
        ElasticLoop(
            _ms_loss,
            optax.sgd(0.1),
            {"w": np.zeros((3, 1), np.float32)},
            lambda s, lay: {},
            step_options=options,
            init_model_state=init_model_state,
        )


def test_a_state_with_model_state_is_checked_part_by_part():

    mesh = Mesh(np.array(jax.local_devices()).reshape(1, -1), AXES)
    tx, params = optax.sgd(0.1), {"w": np.zeros((3, 1), np.float32)}
    template = (params, tx, _MS_INIT)
    state = _start._fresh_state(mesh, *template)
    assert len(state) == 3 and np.shape(state[1]["mean"]) == (len(jax.local_devices()), 3)
    _start._check_state(state, *template)  # fine
    with pytest.raises(ValueError, match=r"must be \(params, model_state, opt_state\).*length 2"):
        _start._check_state((state[0], state[2]), *template)
    wrong = (state[0], {"other": state[1]["mean"]}, state[2])
    with pytest.raises(ValueError, match="its model_state tree does not have the structure"):
        _start._check_state(wrong, *template)
    result = _records._result(state, None, [])
    assert result.model_state is state[1] and result.state == state
    assert _records._result(state[::2], None, []).state == state[::2]  # without: a pair
    out = (*state, jnp.float32(1.0), {"n": 3})
    assert _records._split_outputs(out, 3) == (state, out[3], {"n": 3})
    assert _records._split_outputs(out[1:4], 2) == (state[1:], out[3], None)


# ------------------------------------------- one replica a process (fsdp_axes="local")


def test_the_loop_takes_fsdp_over_its_local_axis_only():

    tx, params = optax.sgd(0.1), {"w": np.zeros((3, 4), np.float32)}
    assert _start._check_loop_args(_loss, tx, {"fsdp_axes": "local"}, None, 3) == (None, 3)
    for bad in ("node", "fsdp", ("node", "local")):
        with pytest.raises(ValueError, match=rf"fsdp_axes={re.escape(repr(bad))} is not supp"):
            ElasticLoop(_loss, tx, params, lambda s, lay: {}, step_options={"fsdp_axes": bad})


def test_a_state_of_one_replica_a_process_is_checked_shard_by_shard():

    mesh = Mesh(np.array(jax.local_devices()).reshape(1, -1), AXES)
    n = len(jax.local_devices())
    tx, params = optax.adam(0.1), {"w": np.zeros((3, 2 * n), np.float32), "b": np.zeros(3)}
    sharded = _start._fresh_state(mesh, params, tx, None, ("local",))
    assert sharded[0]["w"].addressable_shards[0].data.shape == (1, 3, 2)
    _start._check_state(sharded, params, tx, None, ("local",))  # fine
    whole = _start._fresh_state(mesh, params, tx, None)
    _start._check_state(whole, params, tx, None)
    with pytest.raises(ValueError, match=r"split over this process's 8 devices \(shards of shape"):
        _start._check_state(whole, params, tx, None, ("local",))
    with pytest.raises(ValueError, match="one replica of shape .* on each of this process's 8"):
        _start._check_state(sharded, params, tx, None)
