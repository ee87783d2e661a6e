"""Model-parallel and HSDP layouts give the same numbers as plain data parallelism."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tiny_mlp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import lsgd_jax

# the slow tier: 27 s on 2 workers (2026-12-01)
pytestmark = pytest.mark.slow

AUTO3 = (AxisType.Auto,) * 3
STEPS, START, PERIOD = 8, 3, 2


init, loss_fn = tiny_mlp(12, 16, 2, bias=True, scale=0.3)


def batches(n_rows):
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        x = rng.standard_normal((n_rows, 12)).astype(np.float32)
        yield {"x": x, "y": np.sin(x[:, :2]).astype(np.float32)}


def tx_for(process_group=None, post_local_gradient_allreduce=True):
    return optax.chain(
        lsgd_jax.post_local_sgd(
            START,
            process_group=process_group,
            post_local_gradient_allreduce=post_local_gradient_allreduce,
        ),
        optax.sgd(0.1, momentum=0.9),
        lsgd_jax.model_averaging(
            lsgd_jax.PeriodicModelAverager(PERIOD, START, process_group=process_group)
        ),
    )


def place(tree, mesh, n, specs):
    """One copy per replica (leading axis), with the given full specs."""
    return jax.tree.map(
        lambda x, s: jax.device_put(jnp.broadcast_to(x, (n, *x.shape)), NamedSharding(mesh, s)),
        tree,
        specs,
    )


def run(mesh, tx, n, param_specs, axes=None, n_rows=32, lowering="shard_map"):
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, axes=axes, lowering=lowering)
    lead = P(axes or lsgd_jax.data_axes(mesh))[0]
    params = place(init(), mesh, n, param_specs)
    opt_state = jax.tree.map(
        lambda x: jax.device_put(
            jnp.broadcast_to(x, (n, *jnp.shape(x))), NamedSharding(mesh, P(lead))
        ),
        tx.init(init()),
    )
    traj = []
    for batch in batches(n_rows):
        params, opt_state, loss = step(params, opt_state, batch)
        traj.append(jax.tree.map(np.asarray, params))
    return traj, step, params, opt_state


def plain(num_nodes, per_node):
    mesh = lsgd_jax.make_mesh(num_nodes, per_node)
    n = num_nodes * per_node
    specs = jax.tree.map(lambda _: P(("node", "local")), init())
    return run(mesh, tx_for(), n, specs)[0]


@pytest.mark.parametrize("lowering", ["shard_map", "jit"])
def test_model_axis_stays_automatic_and_matches_plain_data_parallel(lowering):
    devices = np.array(jax.devices()).reshape(2, 2, 2)
    mesh = Mesh(devices, ("node", "local", "model"), axis_types=AUTO3)
    specs = {
        "w1": P(("node", "local"), None, "model"),
        "b1": P(("node", "local"), "model"),
        "w2": P(("node", "local"), "model", None),
    }
    traj, step, params, opt_state = run(mesh, tx_for(), 4, specs, lowering=lowering)
    assert params["w1"].sharding.spec == specs["w1"]  # still sharded over "model"
    want = plain(2, 2)
    for got, ref in zip(traj, want):
        for name in got:
            np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, atol=1e-6)
    report = lsgd_jax.communication_report(step, params, opt_state, next(batches(32)))
    # The data-parallel means (gradients, models) are conditional; the only unconditional
    # data-axis collective is the 4-byte mean of the loss that the step returns.
    # data_parallel_step traces each phase on its own: branch k of one switch is
    # (hook phase, averaging) = (local, no), (local, yes), (global, no), (global, yes).
    # Per branch, the data-axis bytes are exactly the half-size (model-sharded) params
    # once per collective the phase needs (XLA may combine or split them).
    half = (12 * 16 + 16 + 16 * 2) * 4 // 2
    per_branch = {}
    for c in report:
        if c.axes and "model" not in c.axes and c.bytes > 4:
            assert c.conditional and c.scope
            k = int(re.search(r"branch_(\d)_fun", c.op_name).group(1))
            per_branch.setdefault(k, {}).setdefault(c.axes, 0)
            per_branch[k][c.axes] += c.bytes
    G = ("node", "local")
    assert per_branch == {
        0: {("local",): half},
        1: {("local",): half, G: half},
        2: {G: half},
        3: {G: 2 * half},
    }


def test_hsdp_params_sharded_inside_the_node_local_sgd_across_nodes():
    devices = np.array(jax.devices()).reshape(2, 4)
    mesh = Mesh(devices, ("node", "local"), axis_types=AUTO3[:2])
    specs = {
        "w1": P("node", None, "local"),
        "b1": P("node", "local"),
        "w2": P("node", "local", None),
    }
    tx = tx_for(process_group="node", post_local_gradient_allreduce=False)
    traj, step, params, opt_state = run(mesh, tx, 2, specs, axes=("node",))
    assert params["w1"].sharding.spec == specs["w1"]
    want = plain(2, 4)  # the same math: grads averaged in the node, models every 2 steps
    for got, ref in zip(traj, want):
        for name in got:
            np.testing.assert_allclose(got[name], np.asarray(ref[name])[::4], rtol=1e-5, atol=1e-6)
    # the two nodes really diverge between averages
    assert not np.allclose(traj[START + 1]["w1"][0], traj[START + 1]["w1"][1])


@pytest.mark.parametrize("read", [lsgd_jax.consensus, lsgd_jax.unreplicate])
def test_consensus_and_unreplicate_refuse_a_leaf_without_a_replica_axis(read):
    """Issue 26, item 6: a step count in the tree gave "AttributeError: 'int' object has
    no attribute 'dtype'", a 0-d leaf an IndexError, and a leaf never replicated was
    averaged over its own elements (or lost all but its first). Each names the leaf,
    its shape, the replicas expected and the fix; every layout the package makes reads."""
    name = read.__name__
    mesh = lsgd_jax.make_mesh(2, 4)
    p = lsgd_jax.replicate({"w": jnp.ones((2, 3)), "b": jnp.arange(3.0)}, mesh)
    fix = rf"lsgd_jax.replicate\(x, mesh\).*{name}\(state\['params'\]\)"
    with pytest.raises(TypeError, match=rf"^{name}: leaf \['step'\] is 5 \(int\).*{fix}"):
        read({"params": p, "step": 5})
    with pytest.raises(TypeError, match=r"leaf \['lr'\] is 0.1 \(float\)"):
        read({"params": p, "lr": 0.1})
    with pytest.raises(
        ValueError, match=rf"leaf \['n'\] has shape \(\), .* leading axis of 8 replicas.*{fix}"
    ):
        read({"params": p, "n": jnp.int32(3)})
    with pytest.raises(
        ValueError,
        match=rf"^{name}: leaf \['bias'\] has shape \(3,\), but per-replica values have a "
        rf"leading axis of 8 replicas \(as leaf \['params'\]\['b'\] is laid out.*{fix}",
    ):
        read({"params": p, "bias": jnp.ones(3)})
    # As long as the replicas, but never replicated: on one device, or whole on each.
    with pytest.raises(ValueError, match=r"leaf \['bias'\] of shape \(8,\) lives on one device"):
        read({"params": p, "bias": jnp.ones(8)})
    whole = jax.device_put(jnp.ones(8), NamedSharding(mesh, P()))
    with pytest.raises(ValueError, match=r"\['bias'\] of shape \(8,\) is one copy on every dev"):
        read({"params": p, "bias": whole})
    rows = jax.device_put(jnp.ones(16), NamedSharding(mesh, P(("node", "local"))))
    with pytest.raises(ValueError, match=r"shape \(16,\), its leading axis split over \('node'"):
        read({"params": p, "batch": rows})
    per_node = lsgd_jax.replicate(jnp.ones(3), mesh, axes=("node",))
    with pytest.raises(ValueError, match=r"leaves \['a'\] and \['params'\]\['b'\] hold 2 and 8"):
        read({"params": p, "a": per_node})
    with pytest.raises(ValueError, match=r"leaf \['c'\] has shape \(3,\).*2 replicas \(as most"):
        read({"a": np.ones((2, 3)), "b": np.ones(2), "c": np.ones(3)})  # no mesh in sight
    model_mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("node", "local", "model"))
    split = jax.device_put(jnp.ones((2, 4)), NamedSharding(model_mesh, P("model")))
    with pytest.raises(ValueError, match=r"split over \('model',\), not over the data axes"):
        read(split)

    # What reads as before: every layout replicate and the step make, and host arrays.
    want = np.asarray(p["b"])[0]
    np.testing.assert_array_equal(read(p)["b"], want)
    np.testing.assert_array_equal(
        read({"params": p, "host": np.zeros((8, 2), np.float32)})["params"]["b"], want
    )
    hsdp = lsgd_jax.replicate(jnp.ones((3, 8)), mesh, axes=("node",), shard_over="local")
    assert read(hsdp).shape == (3, 8)
    # one replica FSDP-split over a process's devices (an elastic run down to one node):
    # the compiler leaves its leading axis of 1 unsplit, P(None, ...)
    alone = jax.device_put(jnp.ones((1, 3, 8)), NamedSharding(mesh, P(None, None, "local")))
    assert read({"w": alone, "n": np.zeros((1,), np.int32)})["w"].shape == (3, 8)
    model = jax.device_put(
        jnp.ones((4, 6)), NamedSharding(model_mesh, P(("node", "local"), "model"))
    )
    assert read({"w": model, "n": lsgd_jax.replicate(np.int32(2), model_mesh)})["w"].shape == (6,)
    assert read({"w": np.ones((2, 3), np.float32), "count": np.array([4, 4])})["count"] == 4
