"""lsgd_jax.elastic._heal in one process: moving each replica's state onto a new mesh
without copies (whole replicas, and replicas split over a process's devices), and the
program that gives joining replicas the survivors' mean params and model state and one
survivor's optimizer state."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import lsgd_jax
from lsgd_jax.elastic import _heal

AXES = ("node", "local")


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
