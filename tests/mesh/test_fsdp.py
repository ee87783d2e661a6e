"""Replicas that span devices (FSDP inside a replica) give the unsharded run's numbers.

A replica's params, optimizer state and averager state are split over the FSDP axes
(``replicate(..., shard_over=)``, ``data_parallel_step(..., fsdp_axes=)``): the same
trajectory as one device per replica, 1/k of the memory per device, and averages that
move one shard per device across replicas.
"""

import jax
import numpy as np
import optax
import pytest
from helpers import tiny_mlp
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import lsgd_jax
from lsgd_jax import comm

# the slow tier: 49 s on 2 workers (2026-12-01)
pytestmark = pytest.mark.slow

STEPS, START, PERIOD = 9, 3, 2


init, loss_fn = tiny_mlp(12, 16, 2, bias=True, scale=0.3)  # init(width=64): wider


def batches(rows=32):
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        x = rng.standard_normal((rows, 12)).astype(np.float32)
        yield {"x": x, "y": np.sin(x[:, :2]).astype(np.float32)}


def averager(**options):
    return lsgd_jax.PeriodicModelAverager(PERIOD, START, **options)


def chain(averager_, process_group=None, post_local_gradient_allreduce=True):
    return optax.chain(
        lsgd_jax.post_local_sgd(
            START,
            process_group=process_group,
            post_local_gradient_allreduce=post_local_gradient_allreduce,
        ),
        optax.adam(0.02),
        lsgd_jax.model_averaging(averager_),
    )


def mesh3(shape=(2, 2, 2)):
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, ("node", "local", "fsdp"), axis_types=(AxisType.Auto,) * 3)


def train(mesh, tx, axes=None, fsdp=None, params0=None):
    params0 = init() if params0 is None else params0
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, axes=axes, fsdp_axes=fsdp)
    params = lsgd_jax.replicate(params0, mesh, axes, shard_over=fsdp)
    opt_state = lsgd_jax.replicate(tx.init(params0), mesh, axes, shard_over=fsdp)
    traj = []
    for batch in batches():
        params, opt_state, loss = step(params, opt_state, batch)
        traj.append(jax.tree.map(np.asarray, params))
    return traj, step, params, opt_state


def assert_same(got, want, stride=1):
    for g, w in zip(got, want, strict=True):
        for name in g:
            np.testing.assert_allclose(g[name], w[name][::stride], rtol=2e-5, atol=2e-6)


OPTIONS = {
    "plain": {},
    "diloco_delay": {
        "outer_optimizer": optax.sgd(0.7, momentum=0.9, nesterov=True),
        "delay": 1,
    },
    "int8_error_feedback": {"communication": comm.quantized(8, error_feedback=True)},
}


@pytest.mark.parametrize("options", OPTIONS, ids=list(OPTIONS))
def test_a_replica_sharded_over_two_devices_trains_like_one_device(options):
    tx = chain(averager(**OPTIONS[options]))
    got, _, params, opt_state = train(mesh3(), tx, fsdp="fsdp")
    want, *_ = train(lsgd_jax.make_mesh(2, 2), tx)
    assert_same(got, want)
    assert params["w1"].sharding.spec == P(("node", "local"), None, "fsdp")
    # the averager's own state follows the params' shards
    (state,) = lsgd_jax.averager_states(opt_state)
    spec_of = {x.shape: x.sharding.spec for x in jax.tree.leaves(params)}
    like_params = [x for x in jax.tree.leaves(opt_state) if x.shape in spec_of and x.ndim > 1]
    own = [x for x in jax.tree.leaves(state) if x.shape in spec_of and x.ndim > 1]
    assert len(like_params) >= 6 and (options == "plain" or own)  # Adam's mu, nu; ours
    for leaf in like_params:
        assert leaf.sharding.spec == spec_of[leaf.shape]
    # the replicas really diverged between averages (the test can tell)
    assert not np.allclose(got[START + 1]["w1"][0], got[START + 1]["w1"][2])


def test_a_node_as_one_sharded_replica_is_post_local_sgd_at_one_over_local_memory():
    """HSDP: one replica per node, its params split over the node's 4 devices."""
    mesh = lsgd_jax.make_mesh(2, 4)
    tx = chain(averager(), process_group="node", post_local_gradient_allreduce=False)
    got, _, params, opt_state = train(mesh, tx, axes=("node",), fsdp="local")
    want, *_ = train(mesh, chain(averager()))  # grads meaned in the node, models every 2
    assert_same(got, want, stride=4)
    w1 = params["w1"]
    assert w1.addressable_shards[0].data.shape == (1, 12, 4)  # a quarter per device


def per_device_bytes(tree):
    out = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out


@pytest.mark.parametrize("k", [1, 2, 4])
def test_per_device_memory_falls_as_one_over_the_shards(k):
    """Params + Adam + every averager buffer (anchor, outer momentum, residual, delayed
    mean), measured from the arrays' shards: 1/k of the unsharded bytes, up to the
    scalars that stay whole."""
    tx = chain(
        averager(
            outer_optimizer=optax.sgd(0.7, momentum=0.9),
            delay=1,
            communication=comm.quantized(8, error_feedback=True),
        )
    )
    params0 = init(width=64)
    mesh = Mesh(
        np.array(jax.devices()[: 2 * k]).reshape(2, 1, k),
        ("node", "local", "fsdp"),
        axis_types=(AxisType.Auto,) * 3,
    )
    params = lsgd_jax.replicate(params0, mesh, shard_over="fsdp")
    opt_state = lsgd_jax.replicate(tx.init(params0), mesh, shard_over="fsdp")
    got = per_device_bytes((params, opt_state))
    whole = sum(
        np.asarray(x).nbytes // 2 for x in jax.tree.leaves((params, opt_state))
    )  # one replica's bytes
    small = sum(
        np.asarray(x).nbytes // 2
        for x in jax.tree.leaves((params, opt_state))
        if x.shape[1:] and all(d % 4 for d in x.shape[1:])
    ) + sum(np.asarray(x).nbytes // 2 for x in jax.tree.leaves((params, opt_state)) if x.ndim == 1)
    assert len(set(got.values())) == 1  # every device holds the same amount
    per_device = next(iter(got.values()))
    assert (whole - small) / k + small == pytest.approx(per_device, rel=1e-6)
    assert small < 0.01 * whole


def test_averages_move_one_shard_per_device_across_replicas():
    tx = chain(averager())
    _, step, params, opt_state = train(mesh3(), tx, fsdp="fsdp")
    report = lsgd_jax.communication_report(step, params, opt_state, next(batches()))
    half = sum(np.asarray(x).nbytes for x in jax.tree.leaves(init())) // 2
    per_branch: dict = {}
    for c in report:
        if c.axes and "fsdp" not in c.axes and c.bytes > 4:  # across replicas
            assert c.conditional and c.scope
            per_branch.setdefault(c.branch, {}).setdefault(c.axes, 0)
            per_branch[c.branch][c.axes] += c.bytes
    # Branch k is (hook phase, averaging): (local, no), (local, yes), (global, no),
    # (global, yes); each mean moves the half of the model a device holds (XLA may
    # combine or split the collectives).
    G = ("node", "local")
    assert per_branch == {
        0: {("local",): half},
        1: {("local",): half, G: half},
        2: {G: half},
        3: {G: 2 * half},
    }
    # inside a replica: its params gathered, its gradients reduced (all-reduce and a
    # slice on CPU, a reduce-scatter on GPU)
    inside = [c for c in report if c.axes == ("fsdp",)]
    assert {c.kind for c in inside} == {"all-gather", "all-reduce"}


def test_fsdp_mistakes_are_errors_that_say_what_to_do():
    mesh, tx = mesh3(), chain(averager())
    with pytest.raises(ValueError, match="not data axes"):
        lsgd_jax.data_parallel_step(loss_fn, tx, mesh, fsdp_axes="local")
    with pytest.raises(ValueError, match="not data axes"):
        lsgd_jax.replicate(init(), mesh, shard_over="fdsp")
    with pytest.raises(ValueError, match="lowering='shard_map'"):
        lsgd_jax.data_parallel_step(loss_fn, tx, mesh, fsdp_axes="fsdp", lowering="jit")
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, fsdp_axes="fsdp")
    params = lsgd_jax.replicate(init(), mesh, shard_over="fsdp")
    opt_state = lsgd_jax.replicate(tx.init(init()), mesh, shard_over="fsdp")
    batch = {"x": np.zeros((12, 12), np.float32), "y": np.zeros((12, 2), np.float32)}
    with pytest.raises(ValueError, match="multiple of 8"):
        step(params, opt_state, batch)


def test_the_batch_rows_of_a_replica_are_split_over_its_devices():
    """The compiled step computes the loss on a quarter of a replica's rows per device."""
    tx = chain(averager())
    mesh = mesh3()
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, fsdp_axes="fsdp")
    params = lsgd_jax.replicate(init(), mesh, shard_over="fsdp")
    opt_state = lsgd_jax.replicate(tx.init(init()), mesh, shard_over="fsdp")
    batch = next(batches())  # 32 rows: 8 per replica, 4 per device
    hlo = step.lower(params, opt_state, batch).compile().as_text()
    x_in = [line for line in hlo.splitlines() if "op_name=\"rest[0][\\'x\\']\"" in line]
    assert x_in and all("f32[4,12]" in line for line in x_in), x_in
    # the first layer's activations: 4 rows per device (8 would be the whole replica's)
    assert "f32[4,16]" in hlo and "f32[8,16]" not in hlo


def test_one_node_of_sharded_replicas_trains_like_one_device():
    """A mesh of one node (an elastic run down to one process): the means over the data
    axes are over one replica; XLA rejects such an all-reduce while the FSDP axis stays
    automatic, so the step leaves it out (it failed to compile before)."""
    diloco = averager(**OPTIONS["diloco_delay"])
    tx = chain(diloco, "node", post_local_gradient_allreduce=False)
    one = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("node", "local"))
    got, *_ = train(one, tx, axes=("node",), fsdp="local")
    want, *_ = train(lsgd_jax.make_mesh(1, 1), tx, axes=("node",))
    assert_same(got, want)
    # and two replicas in one node, each over two devices
    got, *_ = train(mesh3((1, 2, 2)), chain(averager()), fsdp="fsdp")
    want, *_ = train(lsgd_jax.make_mesh(1, 2), chain(averager()))
    assert_same(got, want)
