"""data_parallel_step, replicate/unreplicate/consensus, and the errors users meet."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh_2x4, put
from jax.sharding import PartitionSpec as P
from torch_reference import CFG, NAMES, batches, check, init_params, loss_fn, mesh_2x2

import lsgd_jax


@pytest.mark.parametrize("lowering", ["shard_map", "jit"])
def test_step_builder_reproduces_pytorch(lowering):
    mesh = mesh_2x2()
    tx = optax.chain(
        lsgd_jax.post_local_sgd(CFG["start"]),
        optax.sgd(CFG["lr"], momentum=CFG["momentum"]),
        lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(CFG["period"], CFG["warmup"])),
    )
    step = lsgd_jax.data_parallel_step(
        lambda p, b: loss_fn(p, b["x"], b["y"]), tx, mesh, lowering=lowering
    )
    params = lsgd_jax.replicate(init_params(), mesh)
    opt_state = lsgd_jax.replicate(tx.init(init_params()), mesh)
    xs, ys = batches()  # [steps, world, batch, ...]: rank r's rows are block r of the batch
    traj = {n: [] for n in NAMES}
    for s in range(CFG["steps"]):
        batch = {"x": xs[s].reshape(-1, CFG["din"]), "y": ys[s].reshape(-1, 1)}
        params, opt_state, loss = step(params, opt_state, batch)
        for n in NAMES:
            traj[n].append(np.asarray(params[n]))
        want = (
            np.mean([loss_fn(init_params(), xs[s][r], ys[s][r]) for r in range(4)])
            if s == 0
            else None
        )
        if want is not None:
            np.testing.assert_allclose(loss, want, rtol=1e-6)  # the mean over replicas
    check({n: np.array(v) for n, v in traj.items()})


def mlp_loss(params, model_state, batch):
    h = batch["x"] @ params["w"]
    mean = jnp.mean(h, axis=0)
    new_state = {
        "running_mean": 0.9 * model_state["running_mean"] + 0.1 * mean,
        "count": model_state["count"] + 1,
    }
    loss = jnp.mean((h - mean - batch["y"]) ** 2)
    correct = jnp.sum(jnp.abs(h - batch["y"]) < 1.0).astype(jnp.int32)
    return loss, (new_state, {"correct": correct, "h_mean": jnp.mean(h)})


def model_state_run(tx, mesh, steps):
    """Trains mlp_loss with model state; yields (model_state, loss, aux) per step."""
    step = lsgd_jax.data_parallel_step(mlp_loss, tx, mesh, has_aux=True, with_model_state=True)
    p0 = {"w": jnp.ones((5, 2))}
    s0 = {"running_mean": jnp.zeros(2), "count": jnp.zeros([], jnp.int32)}
    params, model_state = lsgd_jax.replicate(p0, mesh), lsgd_jax.replicate(s0, mesh)
    opt_state = lsgd_jax.replicate(tx.init(p0), mesh)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        batch = {
            "x": rng.standard_normal((32, 5), np.float32),
            "y": rng.standard_normal((32, 2), np.float32),
        }
        params, model_state, opt_state, loss, aux = step(params, model_state, opt_state, batch)
        yield model_state, loss, aux


def test_model_state_is_averaged_with_the_params_and_aux_is_reduced():
    mesh = mesh_2x4()
    averager = lsgd_jax.PeriodicModelAverager(3, warmup_steps=2)
    tx = optax.chain(
        lsgd_jax.post_local_sgd(2, post_local_gradient_allreduce=False),
        optax.sgd(0.05),
        lsgd_jax.model_averaging(averager),
    )
    for s, (model_state, loss, aux) in enumerate(model_state_run(tx, mesh, 9)):
        rm = np.asarray(model_state["running_mean"])
        if averager.level(s):
            np.testing.assert_array_equal(rm, np.broadcast_to(rm[0], rm.shape))  # exact
        elif s >= 2:
            assert not np.allclose(rm[0], rm[4])  # per-replica statistics between averages
        assert aux["correct"].dtype == jnp.int32 and 0 <= int(aux["correct"]) <= 64
        assert aux["h_mean"].shape == () and loss.shape == ()
    np.testing.assert_array_equal(model_state["count"], np.full(8, 9))  # ints: not averaged


def test_replicate_unreplicate_consensus():
    mesh = mesh_2x4()
    tree = {"w": np.arange(6.0, dtype=np.float32).reshape(2, 3), "n": np.int32(4)}
    rep = lsgd_jax.replicate(tree, mesh)
    assert rep["w"].shape == (8, 2, 3) and rep["n"].shape == (8,)
    assert rep["w"].sharding.spec == P(("node", "local"))
    assert len({d for s in rep["w"].addressable_shards for d in [s.device]}) == 8
    np.testing.assert_array_equal(lsgd_jax.unreplicate(rep)["w"], tree["w"])
    diverged = jax.tree.map(
        lambda x: x + jnp.arange(8).reshape((8,) + (1,) * (x.ndim - 1)).astype(x.dtype), rep
    )
    c = lsgd_jax.consensus(diverged)
    np.testing.assert_allclose(c["w"], tree["w"] + 3.5)
    assert int(c["n"]) == 4  # integer leaves: replica 0
    bf = lsgd_jax.consensus(jnp.array([[1.0], [2.0], [4.0]], jnp.bfloat16))
    assert bf.dtype == jnp.bfloat16 and float(bf[0]) == pytest.approx(7 / 3, rel=1e-2)


def test_errors_users_make():
    mesh = mesh_2x4()
    tx = optax.chain(lsgd_jax.post_local_sgd(2), optax.sgd(0.1))
    step = lsgd_jax.data_parallel_step(lambda p, b: jnp.mean((b @ p) ** 2), tx, mesh)
    p = jnp.ones(3)
    rep_p, rep_s = lsgd_jax.replicate(p, mesh), lsgd_jax.replicate(tx.init(p), mesh)
    with pytest.raises(
        ValueError,
        match=r"params leaf \(root\) has shape \(3,\).*lsgd_jax.replicate\(params, mesh\)",
    ):
        step(p, rep_s, jnp.ones((8, 3)))
    one_copy = put(jnp.ones((8, 3)), mesh, P())  # right shape, but one copy for all replicas
    with pytest.raises(ValueError, match="not over the replica axes"):
        step(one_copy, rep_s, jnp.ones((8, 3)))
    with pytest.raises(ValueError, match="opt_state leaf"):
        step(rep_p, tx.init(p), jnp.ones((8, 3)))
    with pytest.raises(ValueError, match=r"batch leaf \(root\) has shape \(30, 3\).*multiple of 8"):
        step(rep_p, rep_s, jnp.ones((30, 3)))
    other = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    with pytest.raises(ValueError, match=r"not \['node'\]"):
        lsgd_jax.data_parallel_step(lambda p, b: 0.0, tx, other, axes=("node", "y"))


def test_specialize_has_one_spelling_and_the_bools_are_its_aliases():
    """Issue 28: "phase", "switch" and "cond" (True and False kept as aliases); the
    one-program spellings are their programs' keys, so the ledger and the step agree."""
    mesh = mesh_2x4()
    tx = optax.chain(
        lsgd_jax.post_local_sgd(2),
        optax.sgd(0.1),
        lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, warmup_steps=2)),
    )
    loss = lambda p, b: jnp.mean((b @ p) ** 2)  # noqa: E731
    p = jnp.ones(3)
    batch = jnp.arange(24.0).reshape(8, 3) / 24
    results, programs = {}, {}
    for spelling in ("phase", True, "switch", "cond", False):
        step = lsgd_jax.data_parallel_step(loss, tx, mesh, specialize=spelling)
        params, state = lsgd_jax.replicate(p, mesh), lsgd_jax.replicate(tx.init(p), mesh)
        for _ in range(5):
            params, state, _ = step(params, state, batch)
        results[spelling] = np.asarray(params)
        programs[spelling] = sorted(map(str, step._programs.made()))
    assert programs["phase"] == programs[True] == ["0", "1", "2"]
    assert programs["switch"] == ["switch"] and programs["cond"] == programs[False] == ["cond"]
    for spelling, value in results.items():
        np.testing.assert_allclose(value, results["phase"], rtol=1e-6, err_msg=str(spelling))


def test_step_options_are_checked():
    """Issue 17, defect 10: truthy look-alikes were accepted, an axis name was split."""
    mesh, tx = mesh_2x4(), optax.chain(lsgd_jax.post_local_sgd(2), optax.sgd(0.1))
    loss = lambda p, b: jnp.mean((b @ p) ** 2)  # noqa: E731
    with pytest.raises(ValueError, match="specialize must be 'phase', 'switch' or 'cond'.*got 1"):
        lsgd_jax.data_parallel_step(loss, tx, mesh, specialize=1)
    with pytest.raises(ValueError, match="got 'phases'"):
        lsgd_jax.data_parallel_step(loss, tx, mesh, specialize="phases")
    with pytest.raises(TypeError, match="donate must be True or False, got 'x'"):
        lsgd_jax.data_parallel_step(loss, tx, mesh, donate="x")
    with pytest.raises(TypeError, match="has_aux must be True or False"):
        lsgd_jax.data_parallel_step(loss, tx, mesh, has_aux=None)
    with pytest.raises(ValueError, match=r"not \['nodes'\]"):  # a name, not its letters
        lsgd_jax.data_parallel_step(loss, tx, mesh, axes="nodes")
    ddp = optax.sgd(0.1)  # the hook's node-local mean needs "local" among the data axes
    assert lsgd_jax.data_parallel_step(loss, ddp, mesh, axes="node").spec.axes == ("node",)
    with pytest.warns(DeprecationWarning, match="overlap=True is deprecated"):
        lsgd_jax.data_parallel_step(loss, tx, mesh, overlap=True)


def test_make_mesh_layout_and_errors():
    mesh = lsgd_jax.make_mesh()
    assert dict(mesh.shape) == {"node": 1, "local": 8}  # one process = one node
    mesh = lsgd_jax.make_mesh(num_nodes=4)
    assert dict(mesh.shape) == {"node": 4, "local": 2}
    assert [d.id for d in mesh.devices.flat] == sorted(d.id for d in jax.devices())
    assert dict(lsgd_jax.make_mesh(devices_per_node=2, devices=jax.devices()[:4]).shape) == {
        "node": 2,
        "local": 2,
    }
    with pytest.raises(ValueError, match="needs 12 devices, but 8 are available"):
        lsgd_jax.make_mesh(3, 4)
    with pytest.raises(ValueError, match="num_nodes must be a positive int, got 0"):
        lsgd_jax.make_mesh(0)


def quadratic_loss(p, b):
    return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


def quadratic_batch(seed, n=64):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((n, 4), np.float32),
        "y": rng.standard_normal((n, 1), np.float32),
    }


@pytest.mark.parametrize("shape", [None, (8, 1), (1, 8), (1, 1)])
def test_meshes_with_size_one_axes_run_many_steps(shape):
    # The default make_mesh() on one process is {'node': 1, 'local': 8}; the step's own
    # outputs used to come back with the size-1 axis dropped from their sharding and fail
    # its input check on the second step.
    mesh = lsgd_jax.make_mesh() if shape is None else lsgd_jax.make_mesh(*shape)
    tx = optax.chain(
        lsgd_jax.post_local_sgd(2),
        optax.sgd(0.1, momentum=0.9),
        lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, warmup_steps=2)),
    )
    p0 = {"w": jnp.zeros((4, 1))}
    step = lsgd_jax.data_parallel_step(quadratic_loss, tx, mesh)
    p, s = lsgd_jax.replicate(p0, mesh), lsgd_jax.replicate(tx.init(p0), mesh)
    for k in range(5):
        p, s, loss = step(p, s, quadratic_batch(k, 8 * mesh.devices.size))
    assert lsgd_jax.assert_replicas_in_sync(s) == {"[0].iter": 2, "[2].step": 5}
    assert np.isfinite(float(loss))


def test_reusing_donated_inputs_raises_instead_of_crashing():
    mesh = mesh_2x4()
    tx = optax.chain(lsgd_jax.post_local_sgd(2), optax.sgd(0.1))
    p0 = {"w": jnp.zeros((4, 1))}
    step = lsgd_jax.data_parallel_step(quadratic_loss, tx, mesh)
    p, s = lsgd_jax.replicate(p0, mesh), lsgd_jax.replicate(tx.init(p0), mesh)
    batch = quadratic_batch(0)
    p2, s2, _ = step(p, s, batch)
    with pytest.raises(ValueError, match=r"params leaf \['w'\] was donated.*returned"):
        step(p, s, batch)
    with pytest.raises(ValueError, match=r"opt_state leaf \[0\].iter was donated"):
        step(p2, s, batch)
    p3, s3, _ = step(p2, s2, batch)  # the returned values work
    keep = lsgd_jax.data_parallel_step(quadratic_loss, tx, mesh, donate=False)
    keep(p3, s3, batch)
    keep(p3, s3, batch)  # nothing donated: reusable


def test_a_chain_without_the_hook_is_ddp():
    mesh = mesh_2x4()
    tx = optax.adamw(1e-2)
    p0 = {"w": jnp.zeros((4, 1))}
    step = lsgd_jax.data_parallel_step(quadratic_loss, tx, mesh)
    p, s = lsgd_jax.replicate(p0, mesh), lsgd_jax.replicate(tx.init(p0), mesh)
    # Single-device reference: the gradient of the mean loss over the global batch.
    ref_p, ref_s = p0, tx.init(p0)
    for k in range(4):
        batch = quadratic_batch(k)
        p, s, _ = step(p, s, batch)
        per_replica = jax.tree.map(lambda x: x.reshape(8, -1, *x.shape[1:]), batch)
        grads = jax.tree.map(
            lambda *g: sum(g) / 8,
            *[
                jax.grad(quadratic_loss)(ref_p, jax.tree.map(lambda x, r=r: x[r], per_replica))
                for r in range(8)
            ],
        )
        updates, ref_s = tx.update(grads, ref_s, ref_p)
        ref_p = optax.apply_updates(ref_p, updates)
    w = np.asarray(p["w"])
    np.testing.assert_array_equal(w, np.broadcast_to(w[0], w.shape))  # replicas identical
    np.testing.assert_allclose(w[0], ref_p["w"], rtol=1e-5, atol=1e-6)


def test_an_averager_without_the_hook_is_refused():
    mesh = mesh_2x4()
    tx = optax.chain(optax.sgd(0.1), lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(4)))
    fix = r"post_local_sgd\(0, post_local_gradient_allreduce=False\)"
    with pytest.raises(ValueError, match=fix):  # when the step is built
        lsgd_jax.data_parallel_step(quadratic_loss, tx, mesh)


def test_model_state_under_multisteps_averages_only_on_emitting_mini_steps():
    mesh = mesh_2x4()
    averager = lsgd_jax.PeriodicModelAverager(2)  # averages at its steps 0, 2, 4, ...
    tx = optax.MultiSteps(
        optax.chain(
            lsgd_jax.post_local_sgd(0, post_local_gradient_allreduce=False),
            optax.sgd(0.05),
            lsgd_jax.model_averaging(averager),
        ),
        every_k_schedule=2,
    )
    averaged = []
    for model_state, _, _ in model_state_run(tx, mesh, 8):
        rm = np.asarray(model_state["running_mean"])
        averaged.append(bool(np.all(rm == rm[0])))
    # Mini-steps 1, 5 emit updates at averager steps 0 and 2; 3 and 7 emit at 1 and 3.
    assert averaged == [False, True, False, False, False, True, False, False]


def test_the_default_keeps_few_programs_queued_per_device():
    """Issue 17, defect 11: XLA's CPU client aborts when more than 32 programs are queued
    per device while each device has one pool thread (8 devices, 2 cores). The step
    waits for the loss of the step 2 calls back by default, so the queue stays short."""
    mesh = mesh_2x4()
    tx = optax.chain(lsgd_jax.post_local_sgd(2), optax.sgd(0.1))
    step = lsgd_jax.data_parallel_step(lambda p, b: jnp.mean((b @ p) ** 2), tx, mesh)
    p = lsgd_jax.replicate(jnp.ones(3), mesh)
    s = lsgd_jax.replicate(tx.init(jnp.ones(3)), mesh)
    losses = []
    for _ in range(6):
        p, s, loss = step(p, s, jnp.ones((8, 3)))
        losses.append(loss)
        pending = [x for x in losses if not x.is_ready()]
        assert len(pending) <= 3, len(pending)  # the 2 allowed, and the one just dispatched
    assert len(step._in_flight) == 2


@pytest.mark.parametrize("lowering", ["shard_map", "jit"])
def test_compiler_options_reach_every_program(lowering):
    mesh = mesh_2x4()
    tx = optax.chain(
        lsgd_jax.post_local_sgd(1),
        optax.sgd(0.1),
        lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, warmup_steps=1)),
    )
    loss = lambda p, b: jnp.mean((b @ p) ** 2)  # noqa: E731
    p0, s0 = lsgd_jax.replicate(jnp.ones(3), mesh), lsgd_jax.replicate(tx.init(jnp.ones(3)), mesh)
    batch = jnp.arange(24.0).reshape(8, 3) / 24

    def run(**kwargs):
        step = lsgd_jax.data_parallel_step(
            loss, tx, mesh, donate=False, lowering=lowering, **kwargs
        )
        p, s = p0, s0
        for _ in range(3):  # phases 1, then 0 and an average
            p, s, _ = step(p, s, batch)
        return step, p

    step, p = run(compiler_options={"xla_embed_ir_in_executable": True})
    _, want = run()
    np.testing.assert_array_equal(np.asarray(p), np.asarray(want))
    assert step.spec.compiler_options == (("xla_embed_ir_in_executable", True),)
    # An unknown option fails the first compile of a program, naming it.
    with pytest.raises(Exception, match="xla_no_such_option"):
        run(compiler_options={"xla_no_such_option": True})
    with pytest.raises(TypeError, match="compiler_options must be a dict.*got \\['x'\\]"):
        lsgd_jax.data_parallel_step(loss, tx, mesh, compiler_options=["x"])


def test_step_donates_its_state():
    mesh = mesh_2x4()
    tx = optax.chain(lsgd_jax.post_local_sgd(1), optax.sgd(0.1))
    step = lsgd_jax.data_parallel_step(lambda p, b: jnp.mean((b @ p) ** 2), tx, mesh)
    params = lsgd_jax.replicate(jnp.ones(3), mesh)
    opt_state = lsgd_jax.replicate(tx.init(jnp.ones(3)), mesh)
    new_params, new_state, _ = step(params, opt_state, jnp.ones((8, 3)))
    assert params.is_deleted()  # donated: no second copy of the params is kept
    assert all(x.is_deleted() for x in jax.tree.leaves(opt_state))
    step(new_params, new_state, jnp.ones((8, 3)))  # the outputs feed the next step
