"""The elastic loop's pieces in one process: device orders per epoch, moving state onto a
new mesh without copies, and the program that heals joining replicas."""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import lsgd_jax
from lsgd_jax.elastic import (
    ElasticLoop,
    _attempts,
    _device_order,
    _heal,
    _membership,
    _records,
    _start,
)

AXES = ("node", "local")


class FakeDevice:
    def __init__(self, id, process_index):
        self.id, self.process_index = id, process_index

    def __repr__(self):
        return f"d{self.id}"


def fake_devices(n_proc, d):
    return {p: [FakeDevice(p * 1000 + k, p) for k in range(d)] for p in range(n_proc)}


@pytest.mark.parametrize("n_proc,d", [(1, 1), (2, 2), (3, 2), (2, 3)])
def test_every_epoch_until_the_cycle_has_its_own_device_order(n_proc, d):
    devices = fake_devices(n_proc, d)
    total = math.factorial(n_proc) * math.factorial(d) ** n_proc
    orders = []
    for epoch in range(total + 1):
        rows = _device_order.device_rows(epoch, devices)
        # Each row is one whole process, with all of its devices.
        assert sorted(r[0].process_index for r in rows) == list(range(n_proc))
        for r in rows:
            assert sorted(x.id for x in r) == [x.id for x in devices[r[0].process_index]]
            assert {x.process_index for x in r} == {r[0].process_index}
        orders.append(tuple(x.id for r in rows for x in r))
    assert orders[0] == tuple(x.id for p in range(n_proc) for x in devices[p])  # as given
    assert len(set(orders[:total])) == total  # no order repeats within a cycle
    assert orders[total] == orders[0]


def test_the_permutation_numbering_matches_itertools():
    items = list("abcd")
    for i, perm in enumerate(itertools.permutations(items)):
        assert _device_order._permutation(i, items) == list(perm)


def test_a_view_survives_its_json_round_trip():
    v = _membership.View(((0, 11), (2, 40)), 3, 57, (2,))
    assert _membership.View.from_json(v.to_json()) == v
    assert v.processes == (0, 2)


def per_replica(mesh, values):
    return jax.device_put(jnp.asarray(values), NamedSharding(mesh, P(AXES)))


def test_reshard_keeps_each_devices_values_on_a_permuted_mesh():
    devs = jax.devices()
    a = Mesh(np.array(devs).reshape(2, 4), AXES)
    rows = [devs[4:][::-1], devs[:4][1:] + devs[:1]]  # other row order, other local order
    b = Mesh(np.array(rows), AXES)
    x = per_replica(a, np.arange(8.0)[:, None] * np.ones((8, 3)))
    before = {s.device: np.asarray(s.data) for s in x.addressable_shards}
    y = _heal.reshard({"w": x}, b, AXES)["w"]
    assert y.sharding.mesh.devices.tolist() == b.devices.tolist()
    after = {s.device: np.asarray(s.data) for s in y.addressable_shards}
    assert after.keys() == before.keys()
    for dev in before:
        np.testing.assert_array_equal(after[dev], before[dev])
    # The replica axis follows the new mesh's order.
    expected = [before[d][0] for d in b.devices.flat]
    np.testing.assert_array_equal(np.asarray(y), np.stack(expected))


def test_heal_gives_joiners_the_survivors_mean_and_one_survivors_state():
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), AXES)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 5)).astype(np.float32)
    mu = rng.standard_normal((8, 5)).astype(np.float32)
    count = np.arange(8, dtype=np.int32) + 100
    joining = np.array([0, 0, 1, 1, 0, 0, 1, 1], bool)  # rows 1 and 3 join
    source = np.array([0, 0, 0, 0, 1, 0, 0, 0], bool)  # replica 4's state is copied
    params = {"w": per_replica(mesh, w), "step": per_replica(mesh, count)}
    state = {"mu": per_replica(mesh, mu), "count": per_replica(mesh, count)}
    p, s = _heal._heal_program(mesh, AXES)(
        params, state, per_replica(mesh, joining), per_replica(mesh, source)
    )
    keep = ~joining
    want_w = np.where(joining[:, None], w[keep].mean(0), w)
    np.testing.assert_allclose(np.asarray(p["w"]), want_w, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(p["step"]), np.where(joining, 104, count))
    np.testing.assert_array_equal(np.asarray(s["mu"]), np.where(joining[:, None], mu[4], mu))
    np.testing.assert_array_equal(np.asarray(s["count"]), np.where(joining, 104, count))


def test_a_joiner_starts_with_a_zero_error_feedback_residual():
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), AXES)
    tx = lsgd_jax.model_averaging(
        lsgd_jax.PeriodicModelAverager(4, 0, communication=lsgd_jax.comm.quantized(8))
    )
    state = lsgd_jax.replicate(tx.init({"w": jnp.zeros(3)}), mesh)
    residual = np.arange(24, dtype=np.float32).reshape(8, 3) + 1
    state = dataclasses.replace(
        state,
        comm_state={"w": per_replica(mesh, residual)},
        step=per_replica(mesh, np.arange(8) + 5),
    )
    joining = np.array([0, 0, 1, 1, 0, 0, 0, 0], bool)
    source = np.eye(8, dtype=bool)[0]
    params = {"w": per_replica(mesh, np.ones((8, 3), np.float32))}
    _, s = _heal._heal_program(mesh, AXES)(
        params, state, per_replica(mesh, joining), per_replica(mesh, source)
    )
    want = np.where(joining[:, None], 0.0, residual)
    np.testing.assert_array_equal(np.asarray(s.comm_state["w"]), want)
    np.testing.assert_array_equal(np.asarray(s.step), np.where(joining, 5, np.arange(8) + 5))


def test_the_loop_refuses_options_a_retry_cannot_have():
    with pytest.raises(ValueError, match=r"\['donate'\]"):
        ElasticLoop(lambda p, b: 0.0, None, {}, None, step_options={"donate": True})


def test_initialize_refuses_a_running_backend():
    jax.devices()  # the tests' backend is up
    with pytest.raises(RuntimeError, match="before any other JAX call"):
        lsgd_jax.elastic.initialize("127.0.0.1:1", 2, 0)
    with pytest.raises(ValueError, match="platform must be"):
        lsgd_jax.elastic.initialize("127.0.0.1:1", 2, 0, platform="tpu")


# Misuse is refused before any JAX or network work (these run with the tests' backend
# already up: each check comes before initialize's "backend is running" one).
@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        (("127.0.0.1:1", 2, 0), {"num_cpu_devices": 0}, "num_cpu_devices.*got 0"),
        (("127.0.0.1:1", 2, 0), {"num_cpu_devices": -2}, "num_cpu_devices.*got -2"),
        (("127.0.0.1:1", 2, -1), {}, r"process_id must be in \[0, 2\).*got -1"),
        (("127.0.0.1:1", 1, 1), {}, r"process_id must be in \[0, 1\).*got 1;"),
        (("127.0.0.1", 2, 0), {}, "'host:port'.*got '127.0.0.1'"),
        (("127.0.0.1:http", 2, 1), {}, "'host:port'.*got '127.0.0.1:http'"),
        (("127.0.0.1:70000", 2, 0), {}, "'host:port'.*got '127.0.0.1:70000'"),
        (("127.0.0.1:1", 0, 0), {}, "num_processes.*got 0"),
        (("127.0.0.1:1", 2, 0), {"initialization_timeout_s": 0}, "initialization_timeout_s"),
        (("127.0.0.1:1", 2, 0), {"heartbeat_timeout_s": -3}, "heartbeat_timeout_s"),
    ],
)
def test_initialize_refuses_bad_counts_ids_addresses_and_timeouts(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        lsgd_jax.elastic.initialize(*args, **kwargs)


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"]) ** 2)


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


@pytest.mark.parametrize("timeout_s", [0, -1.0])
def test_shutdown_refuses_a_timeout_that_is_not_positive(timeout_s):
    with pytest.raises(ValueError, match=f"timeout_s must be a positive number.*got {timeout_s}"):
        lsgd_jax.elastic.shutdown(None, timeout_s)


def test_the_watchdog_does_not_count_compilation_but_does_count_a_stall():
    fired = []

    def slow_to_trace(x):
        time.sleep(3.5)  # in the trace: compilation, for the watchdog (limit 1.5 s)
        return x + 1

    x = jnp.zeros(3)
    dog = _attempts.Watchdog(1.5, on_stall=fired.append)
    try:
        dog.arm("compiling step")  # a first call: trace, lower, compile, run
        jax.block_until_ready(jax.jit(slow_to_trace)(x))
        dog.disarm()
        assert fired == []
        dog.arm("stalled step")
        deadline = time.monotonic() + 60  # a stall in Python: the watchdog fires
        while not fired and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fired == ["stalled step"]
    finally:
        dog.disarm()
        dog.close()


def test_the_leader_is_the_lowest_live_process_that_holds_the_model():
    View = _membership.View
    # Before any view: the lowest live process, whichever it is.
    assert _membership.leader(((1, 7), (2, 8)), None) == 1
    latest = View(((0, 5), (1, 6), (2, 7)), 3, 20, ())
    assert _membership.leader(((0, 5), (1, 6), (2, 7)), latest) == 0
    assert _membership.leader(((1, 6), (2, 7)), latest) == 1  # process 0 died
    # Process 0 came back (a new incarnation): it joins, it does not lead.
    assert _membership.leader(((0, 9), (1, 6), (2, 7)), latest) == 1
    back = View(((0, 9), (1, 6), (2, 7)), 4, 26, (0,))
    assert _membership.leader(((0, 9), (2, 7)), back) == 2  # joining in the last one
    assert _membership.leader(((0, 9),), back) is None  # nobody holds the model
    # ... unless an attempt of that view committed: process 0 was healed then (seen in
    # the soak: the sole survivor had joined in the last view, and was refused).
    assert _membership.leader(((0, 9),), back, committed=4) == 0
    assert _membership.leader(((0, 9),), back, committed=3) is None  # an older commit


class FakeStore:
    """The coordination service's key-value store, as ``Membership`` uses it."""

    def __init__(self):
        self.kv: dict[str, str] = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        self.kv[key] = value

    def key_value_try_get(self, key):
        if key not in self.kv:
            raise KeyError(key)
        return self.kv[key]

    def key_value_delete(self, key):
        self.kv.pop(key, None)

    def blocking_key_value_get(self, key, timeout_ms):
        return self.key_value_try_get(key)


def test_a_failed_attempt_with_the_same_members_gets_a_new_epoch(monkeypatch):
    store = FakeStore()
    monkeypatch.setattr(_membership, "client", lambda: store)
    m = _membership.Membership(timeout_s=1.0)
    members = ((0, 5), (1, 6), (2, 7))
    first = m.agree(members, 0, 0, None)
    assert (first.epoch, first.joining) == (0, ())
    assert m.agree(members, 3, 1, first) == first  # unchanged: no new record
    # Step 3's attempt of epoch 0 failed everywhere (a collective timed out): a process
    # that is not the leader reads the old record and waits for the leader's new one.
    with pytest.raises(RuntimeError, match="no new membership record after the failed attempt"):
        m.agree(members, 3, 1, first, failed=0)
    retry = m.agree(members, 3, 0, first, failed=0)  # the leader records it
    assert (retry.members, retry.epoch, retry.step, retry.joining) == (members, 1, 3, ())
    assert m.agree(members, 3, 1, first, failed=0) == retry  # now the others read it
    assert m.agree(members, 3, 2, first, failed=None) == retry
    devices = {p: [f"{p}a", f"{p}b"] for p in range(3)}
    assert _device_order.device_rows(1, devices) != _device_order.device_rows(0, devices)
    # A failure of an older epoch does not bump the current one again.
    assert m.agree(members, 3, 0, retry, failed=0) == retry
    # A failure only some processes saw after agreeing: the leader's own attempt failed
    # before it agreed (in the barrier), process 2's after. Process 2's mark, written
    # before the retry's barrier, makes the leader record a new epoch too (before, it
    # returned the old view and process 2 waited for a new one: 120 s, then an error).
    _membership.mark_failed(1)
    again = m.agree(members, 3, 0, retry, failed=None)
    assert (again.epoch, again.members) == (2, members)
    assert m.agree(members, 3, 2, retry, failed=1) == again
    assert m.agree(members, 3, 1, retry, failed=None) == again  # the third reads it too
    store.kv[_membership.FAILED] = "-1"  # (the rest of this test knows no failure)
    retry = again
    # The committed mark: after process 2 restarts and joins at epoch 2, which commits,
    # it holds the model even if it is the only one left.
    back = ((0, 5), (1, 6), (2, 8))
    joined = m.agree(back, 5, 0, retry)
    assert (joined.epoch, joined.joining) == (3, (2,))
    _membership.mark_committed(3)
    alone = m.agree(((2, 8),), 6, 2, joined)
    assert (alone.epoch, alone.joining, alone.processes) == (4, (), (2,))


def test_when_no_live_process_holds_the_model_every_one_restarts_from_a_checkpoint(monkeypatch):
    store = FakeStore()
    monkeypatch.setattr(_membership, "client", lambda: store)
    m = _membership.Membership(timeout_s=1.0)
    # Process 0 held the model alone; process 1 (restarted) was joining at epoch 4 when 0
    # died: the live process 1 holds nothing (seen in the soak).
    joined = m.agree(((0, 5),), 30, 0, None)
    store.kv[_membership.LATEST] = _membership.View(((0, 5), (1, 9)), 4, 31, (1,)).to_json()
    asked = []

    def newest():
        asked.append(True)
        return 25

    # Without a way to restart: the run cannot go on, on every process.
    with pytest.raises(lsgd_jax.elastic.CoordinatorLostError, match="no checkpoint to restart"):
        m.agree(((1, 9),), 0, 1, None)
    view = m.agree(((1, 9),), 0, 1, None, restart_step=newest)
    assert asked and (view.restart, view.step, view.epoch, view.joining) == (True, 25, 5, (1,))
    assert _membership.View.from_json(view.to_json()) == view
    # Its attempt failed (another death): nobody holds the model yet, so the retry
    # restarts again, in a new epoch.
    again = m.agree(((1, 9),), 25, 1, None, failed=5, restart_step=newest)
    assert (again.restart, again.step, again.epoch) == (True, 25, 6)
    # Once an attempt of it committed, its members hold the model: process 0, back, joins.
    _membership.mark_committed(6)
    back = m.agree(((0, 12), (1, 9)), 27, 1, again, restart_step=newest)
    assert (back.restart, back.step, back.joining, back.epoch) == (False, 27, (0,), 7)
    # Nothing to restart from: the leader records so, and every process raises.
    store.kv[_membership.LATEST] = joined.to_json()
    members = ((1, 9), (2, 3))
    with pytest.raises(lsgd_jax.elastic.CoordinatorLostError, match=r"live now: \[1, 2\]"):
        m.agree(members, 0, 1, None, restart_step=lambda: None)
    with pytest.raises(lsgd_jax.elastic.CoordinatorLostError, match="no checkpoint to restart"):
        m.agree(members, 0, 2, None, restart_step=lambda: 7)  # not asked: not the leader


def test_initialize_refuses_an_external_coordinator_that_is_not_a_bool():
    with pytest.raises(TypeError, match="external_coordinator must be True or False.*'yes'"):
        lsgd_jax.elastic.initialize("127.0.0.1:1", 2, 0, external_coordinator="yes")


@pytest.mark.parametrize(
    "args,match",
    [
        (["--port", "0", "--processes", "2"], "port must be in 1-65535, got 0"),
        (["--port", "9876", "--processes", "0"], "num_processes.*got 0"),
    ],
)
def test_the_coordinator_refuses_a_bad_port_or_count(args, match, capsys):
    from lsgd_jax import elastic_coordinator

    with pytest.raises(SystemExit) as e:
        elastic_coordinator.main(args)
    assert e.value.code == 2
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.parametrize(
    "directory,every,error,match",
    [
        (None, 5, ValueError, "checkpoint_every=5 needs checkpoint_dir"),
        ("/tmp/ckpt", None, ValueError, "checkpoint_dir='/tmp/ckpt' needs checkpoint_every"),
        ("/tmp/ckpt", 0, ValueError, "checkpoint_every must be a positive int, got 0"),
        ("/tmp/ckpt", 2.5, TypeError, "checkpoint_every must be a Python int, got 2.5"),
        (7, 5, TypeError, "checkpoint_dir must be a folder path.*got 7"),
        ("", 5, TypeError, "checkpoint_dir must be a folder path.*got ''"),
    ],
)
def test_the_loop_refuses_bad_checkpoint_arguments(directory, every, error, match):
    def loss_fn(params, batch):
        return jnp.sum(params["w"] * batch)

    tx = optax.sgd(0.1)
    with pytest.raises(error, match=match):
        ElasticLoop(
            loss_fn,
            tx,
            {"w": jnp.zeros(2)},
            lambda step, layout: None,
            checkpoint_dir=directory,
            checkpoint_every=every,
        )


def test_the_loop_refuses_a_checkpoint_dir_that_is_a_file(tmp_path):
    from lsgd_jax.elastic import _elastic_checkpoint

    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        _elastic_checkpoint.check_args(tmp_path / "f", 3)
    assert _elastic_checkpoint.check_args(tmp_path / "new", 3) == (str(tmp_path / "new"), 3)


def test_only_finalized_checkpoint_steps_are_listed(tmp_path):
    # A finalized step 2; a save of step 4 that never finished (orbax's temporary
    # folder, and an elastic writer's staging folder, as a writer killed mid-save
    # leaves them); a set-aside damaged step 6 and a stray file: the latest is 2.
    # (The elastic writer itself: tests/system/test_elastic_checkpoint.py.)
    from lsgd_jax.elastic import _elastic_checkpoint

    mesh = lsgd_jax.make_mesh(2, 2)
    params = {"w": jnp.ones(3)}
    state = {"params": lsgd_jax.replicate(params, mesh)}
    assert _elastic_checkpoint.latest_step(tmp_path / "missing") is None
    assert [s for s in range(7) if _elastic_checkpoint.Checkpoints("d", 2).due(s)] == [2, 4, 6]
    lsgd_jax.save_checkpoint(tmp_path, 2, state)
    for partial in ("4.orbax-checkpoint-tmp", ".lsgd-staging-4-1/ckpt/4.orbax-checkpoint-tmp"):
        (tmp_path / partial / "arrays").mkdir(parents=True)
        (tmp_path / partial / "_CHECKPOINT_METADATA").write_text("{")
    (tmp_path / "6.unreadable").mkdir()
    (tmp_path / "notes").write_text("x")
    assert _elastic_checkpoint.latest_step(tmp_path) == 2
    assert lsgd_jax.latest_checkpoint_step(tmp_path) == 2
    assert _elastic_checkpoint.finalized(str(tmp_path), 2)
    assert not _elastic_checkpoint.finalized(str(tmp_path), 4)


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


def test_checkpoint_trees_carry_model_state_only_when_the_loop_has_it():
    from lsgd_jax.elastic import _elastic_checkpoint as ec

    assert ec.as_dict(("p", "o")) == {"params": "p", "opt_state": "o"}
    assert ec.as_dict(("p", "m", "o")) == {"params": "p", "opt_state": "o", "model_state": "m"}
    assert ec.as_state(ec.as_dict(("p", "m", "o"))) == ("p", "m", "o")
    assert ec.as_state({"params": "p", "opt_state": "o"}) == ("p", "o")


def test_a_joiner_gets_the_survivors_mean_model_state_like_the_params():
    # adopt heals (params, model_state) as one tree by the mean, opt_state by one source.
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), AXES)
    rng = np.random.default_rng(1)
    w, mean = rng.standard_normal((8, 3)), rng.standard_normal((8, 5))
    seen = np.arange(8, dtype=np.int32)
    joining = np.array([0, 0, 0, 0, 1, 1, 0, 0], bool)
    source = np.eye(8, dtype=bool)[2]
    params = {"w": per_replica(mesh, w.astype(np.float32))}
    model = {"mean": per_replica(mesh, mean.astype(np.float32)), "seen": per_replica(mesh, seen)}
    state = {"count": per_replica(mesh, seen)}
    (p, m), s = _heal._heal_program(mesh, AXES)(
        (params, model), state, per_replica(mesh, joining), per_replica(mesh, source)
    )
    keep = ~joining
    want = np.where(joining[:, None], mean[keep].mean(0), mean)
    np.testing.assert_allclose(np.asarray(m["mean"]), want, rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(p["w"]), np.where(joining[:, None], w[keep].mean(0), w), rtol=1e-5
    )
    np.testing.assert_array_equal(np.asarray(m["seen"]), np.where(joining, 2, seen))  # ints: picked
    np.testing.assert_array_equal(np.asarray(s["count"]), np.where(joining, 2, seen))


def test_a_process_the_others_declared_dead_is_told_to_restart():
    """After a SIGSTOP longer than the heartbeat timeout the live set no longer holds
    this process: it raises LeftBehindError (not posted as a user error, so the others
    go on), instead of a StopIteration that ended every process (found by the soak)."""
    from lsgd_jax.elastic import _attempts

    with pytest.raises(
        lsgd_jax.elastic.LeftBehindError, match=r"process 0 is not among .*\[1, 2\]"
    ):
        _attempts.check_members(((1, 4), (2, 4)), 0, external=True)
    with pytest.raises(lsgd_jax.elastic.CoordinatorLostError, match="process 0"):
        _attempts.check_members(((1, 4), (2, 4)), 1, external=False)
    assert _attempts.check_members(((1, 4), (2, 4)), 1, external=True) == ((1, 4), (2, 4))
    assert lsgd_jax.elastic.LeftBehindError in _attempts._NOT_THE_USERS


def test_the_elastic_example_reads_the_digits_scikit_learn_ships():
    # Read from the package's file without importing scikit-learn (1.8 s of every
    # trainer's start): the same arrays as load_digits.
    import importlib.util
    import pathlib

    from sklearn.datasets import load_digits

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "elastic.py"
    spec = importlib.util.spec_from_file_location("elastic_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    x, y = example._digits()
    want_x, want_y = load_digits(return_X_y=True)
    np.testing.assert_array_equal(x, want_x)
    np.testing.assert_array_equal(y, want_y)


# ------------------------------------------- one replica a process (fsdp_axes="local")


def fsdp_replicas(mesh, values):
    """Per-process replicas (one a mesh row), each leaf split over the row's devices as
    lsgd_jax.replicate(..., axes=("node",), shard_over="local") lays it out."""
    from lsgd_jax._core._replicas import replica_spec

    spec = replica_spec(np.shape(values)[1:], mesh, ("node",), ("local",))
    return jax.device_put(jnp.asarray(values), NamedSharding(mesh, spec))


def test_reshard_gives_each_device_the_shard_of_its_new_position_in_its_replica():
    devs = jax.devices()
    a = Mesh(np.array(devs).reshape(2, 4), AXES)
    rows = [devs[4:][::-1], devs[:4][1:] + devs[:1]]  # other row order, other local order
    b = Mesh(np.array(rows), AXES)
    w = np.arange(2 * 3 * 8, dtype=np.float32).reshape(2, 3, 8)  # two replicas
    bias = np.arange(2 * 3, dtype=np.float32).reshape(2, 3)  # 3 does not split: whole
    x = {"w": fsdp_replicas(a, w), "b": fsdp_replicas(a, bias)}
    assert x["w"].sharding.spec == P("node", None, "local")
    y = _heal.reshard(x, b, ("node",), ("local",))
    assert y["w"].sharding.spec == P("node", None, "local") and y["b"].sharding.spec == P("node")
    # Replica 0 (row 0 of a) is row 1 of b, and the other way round.
    np.testing.assert_array_equal(np.asarray(y["w"]), w[::-1])
    np.testing.assert_array_equal(np.asarray(y["b"]), bias[::-1])
    # Devices changed positions inside their rows: some now hold another quarter.
    before = {s.device: s.index for s in x["w"].addressable_shards}
    moved = [s.device for s in y["w"].addressable_shards if s.index[2] != before[s.device][2]]
    assert moved, "the test must move shards between devices"
    for s in y["w"].addressable_shards:  # each device holds its own new quarter
        np.testing.assert_array_equal(np.asarray(s.data), np.asarray(y["w"])[s.index])


def test_heal_moves_each_shard_across_replicas_only():
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), AXES)
    rng = np.random.default_rng(2)
    w = rng.standard_normal((4, 3, 6)).astype(np.float32)
    mu = rng.standard_normal((4, 3, 6)).astype(np.float32)
    count = np.arange(4, dtype=np.int32) + 7
    params = {"w": fsdp_replicas(mesh, w)}
    state = {"mu": fsdp_replicas(mesh, mu), "count": fsdp_replicas(mesh, count)}
    joining = np.array([0, 1, 0, 1], bool)
    source = np.array([0, 0, 1, 0], bool)
    flags = [jax.device_put(f, NamedSharding(mesh, P("node"))) for f in (joining, source)]
    specs = jax.tree.map(lambda v: v.sharding.spec, (params, state))
    p, s = _heal._heal_program(mesh, ("node",), specs)(params, state, *flags)
    assert p["w"].sharding.spec == P("node", None, "local")
    assert p["w"].addressable_shards[0].data.shape == (1, 3, 3)  # half a replica a device
    want = np.where(joining[:, None, None], w[~joining].mean(0), w)
    np.testing.assert_allclose(np.asarray(p["w"]), want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(s["mu"]), np.where(joining[:, None, None], mu[2], mu))
    np.testing.assert_array_equal(np.asarray(s["count"]), np.where(joining, 9, count))


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


def test_a_layout_counts_a_process_as_one_replica_when_the_replica_spans_it():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), AXES)
    assert _membership.Layout((0, 1), 0, 4, 0, mesh).num_replicas == 8
    assert _membership.Layout((0, 1), 0, 4, 0, mesh, True).num_replicas == 2
