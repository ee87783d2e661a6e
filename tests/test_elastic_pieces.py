"""The elastic loop's pieces in one process: device orders per epoch, moving state onto a
new mesh without copies, and the program that heals joining replicas."""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import lsgd_jax
from lsgd_jax import _heal, _membership
from lsgd_jax.elastic import ElasticLoop

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
        rows = _membership.device_rows(epoch, devices)
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
        assert _membership._permutation(i, items) == list(perm)


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
