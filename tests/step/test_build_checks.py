"""What a step checks when it is built, before the first step: the chain's order, every
phase on the mesh, and meshes with Explicit axes (issue 26, items 1, 4 and 5)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh_2x4
from jax.sharding import AxisType, Mesh

import lsgd_jax

LOSS = lambda p, b: jnp.mean((b @ p["w"]) ** 2)  # noqa: E731
P0 = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(3, 2)}


def hook(start=4, **kwargs):
    return lsgd_jax.post_local_sgd(start, **kwargs)


def avg(warmup=4, **kwargs):
    return lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, warmup, **kwargs))


def pls_opt():
    return lsgd_jax.post_local_sgd_optimizer(
        optax.sgd(0.1), lsgd_jax.PeriodicModelAverager(2, warmup_steps=4)
    )


WRONG = {  # name: (tx, what the message must say)
    "adam before the hook": (
        optax.chain(optax.adamw(1e-3), hook(), avg()),
        r"post_local_sgd must come first .* position 1 of chain\(chain\(ScaleByAdamState",
    ),
    "averaging before the optimizer": (
        optax.chain(hook(), avg(), optax.adamw(1e-3)),
        r"model_averaging must come last .* position 1 of chain\(post_local_sgd, "
        r"model_averaging, chain\(ScaleByAdamState",
    ),
    "a clip before the hook": (
        optax.chain(optax.clip_by_global_norm(1.0), hook(), optax.sgd(0.1), avg()),
        r"post_local_sgd must come first .* position 1 of chain\(EmptyState, post_local_sgd",
    ),
    "a nested chain after the averaging": (
        optax.chain(optax.chain(hook(), optax.sgd(0.1), avg()), optax.scale(0.5)),
        r"model_averaging must come last .* which holds it, sits at position 0",
    ),
    "a named chain": (
        optax.named_chain(("opt", optax.sgd(0.1)), ("hook", hook()), ("avg", avg())),
        r"position 1 of named_chain\(opt=chain\(EmptyState, EmptyState\), hook=post_local_sgd",
    ),
    "inside MultiSteps": (
        optax.MultiSteps(optax.chain(optax.sgd(0.1), hook(), avg()), every_k_schedule=2),
        r"post_local_sgd must come first",
    ),
    "inside inject_hyperparams' neighbour": (
        optax.chain(hook(), avg(), optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)),
        r"model_averaging must come last .* InjectStatefulHyperparamsState",
    ),
    "post_local_sgd_optimizer not last": (
        optax.chain(hook(), pls_opt(), optax.scale(1.0)),
        r"post_local_sgd_optimizer must come last .* position 1",
    ),
}


def counting(tx, as_dict):
    """A wrapper of one's own, keeping a count beside the inner state."""

    def init(params):
        inner, n = tx.init(params), jnp.zeros([], jnp.int32)
        return {"inner": inner, "n": n} if as_dict else (inner, n)

    def update(g, state, params=None):
        inner, n = (state["inner"], state["n"]) if as_dict else state
        u, inner = tx.update(g, inner, params)
        return u, ({"inner": inner, "n": n + 1} if as_dict else (inner, n + 1))

    return optax.GradientTransformation(init, update)


RIGHT = {
    "own wrapper, dict state": counting(optax.chain(hook(), optax.sgd(0.1), avg()), True),
    "own wrapper, tuple state": counting(optax.chain(hook(), optax.sgd(0.1), avg()), False),
    "plain": optax.chain(hook(), optax.adamw(1e-3), avg()),
    "clip after the hook": optax.chain(
        hook(), optax.clip_by_global_norm(1.0), optax.adamw(1e-3), avg()
    ),
    "MultiSteps": optax.MultiSteps(optax.chain(hook(), optax.sgd(0.1), avg()), 2),
    "inject_hyperparams": optax.chain(
        hook(), optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3), avg()
    ),
    "named chain": optax.named_chain(("h", hook()), ("o", optax.sgd(0.1)), ("a", avg())),
    "apply_if_finite": optax.apply_if_finite(optax.chain(hook(), optax.sgd(0.1), avg()), 3),
    "post_local_sgd_optimizer": optax.chain(hook(), pls_opt()),
    "nested chains": optax.chain(optax.chain(hook(), optax.sgd(0.1)), optax.chain(avg())),
}


@pytest.mark.parametrize("name", WRONG)
def test_a_chain_in_the_wrong_order_is_refused_when_the_step_is_built(name):
    tx, message = WRONG[name]
    with pytest.raises(ValueError, match=message):
        lsgd_jax.check_configuration(tx.init(P0))
    with pytest.raises(ValueError, match=message + ".*check_order=False"):
        lsgd_jax.data_parallel_step(LOSS, tx, mesh_2x4())
    with pytest.raises(ValueError, match=message):
        lsgd_jax.stacked(tx, mesh_2x4())


@pytest.mark.parametrize("name", RIGHT)
def test_the_right_order_passes_through_every_wrapper(name):
    tx = RIGHT[name]
    lsgd_jax.check_configuration(tx.init(P0))
    lsgd_jax.data_parallel_step(LOSS, tx, mesh_2x4())


def test_an_order_composed_on_purpose_is_allowed_and_trains():
    tx = optax.chain(hook(2), avg(2), optax.scale(1.0))  # a no-op after the averaging
    lsgd_jax.check_configuration(tx.init(P0), check_order=False)
    mesh = mesh_2x4()
    step = lsgd_jax.data_parallel_step(LOSS, tx, mesh, check_order=False)
    p, s = lsgd_jax.replicate(P0, mesh), lsgd_jax.replicate(tx.init(P0), mesh)
    batch = jax.random.normal(jax.random.key(0), (16, 3))
    for _ in range(3):
        p, s, loss = step(p, s, batch)
    assert np.isfinite(float(loss))
    with pytest.raises(TypeError, match="check_order must be True or False"):
        lsgd_jax.data_parallel_step(LOSS, tx, mesh, check_order="no")
    # an averager before the hook is never meant: refused even then
    with pytest.raises(ValueError, match="comes before post_local_sgd"):
        lsgd_jax.check_configuration(optax.chain(avg(), hook()).init(P0), check_order=False)


def test_a_tx_whose_init_needs_the_params_is_checked_at_the_first_call():
    # optax.masked with a mask tree cannot init the probe: the first trace checks it.
    inner = optax.chain(optax.sgd(0.1), hook(), avg())
    tx = optax.masked(inner, {"w": True})
    mesh = mesh_2x4()
    step = lsgd_jax.data_parallel_step(LOSS, tx, mesh)  # nothing to check yet
    p, s = lsgd_jax.replicate(P0, mesh), lsgd_jax.replicate(tx.init(P0), mesh)
    with pytest.raises(ValueError, match="post_local_sgd must come first"):
        step(p, s, jnp.ones((8, 3)))


def one_axis_mesh():
    return Mesh(np.array(jax.devices()), ("data",))


def test_a_mesh_without_a_node_axis_is_refused_before_the_warmup_not_at_the_switch():
    # It used to train through the warm-up and fail at step 3 with an error about
    # axis_index_groups and check_vma=False, neither of which the user wrote.
    tx = optax.chain(hook(3), optax.sgd(0.1))
    with pytest.raises(ValueError) as e:
        lsgd_jax.data_parallel_step(LOSS, tx, one_axis_mesh())
    message = str(e.value)
    assert "phase 0 (post_local_sgd's node-local gradient mean (from step 3 on))" in message
    assert "lsgd_jax.make_mesh(num_nodes, devices_per_node)" in message
    assert "subgroup=" in message and "post_local_gradient_allreduce=False" in message
    assert "check_vma" not in message
    with pytest.raises(ValueError, match="node-local gradient mean"):
        lsgd_jax.stacked(tx, one_axis_mesh())
    # what the message offers works: no gradient mean after the switch runs on it
    ok = optax.chain(hook(3, post_local_gradient_allreduce=False), optax.sgd(0.1))
    mesh = one_axis_mesh()
    step = lsgd_jax.data_parallel_step(LOSS, ok, mesh)
    p, s = lsgd_jax.replicate(P0, mesh), lsgd_jax.replicate(ok.init(P0), mesh)
    for _ in range(4):
        p, s, _ = step(p, s, jnp.ones((8, 3)))


def test_data_axes_without_local_are_refused_when_the_hook_needs_it():
    tx = optax.chain(hook(2), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"axes \('node',\).*'local'"):
        lsgd_jax.data_parallel_step(LOSS, tx, mesh_2x4(), axes="node")


def test_every_averaging_level_and_strategy_is_checked_on_the_mesh():
    mesh = mesh_2x4()
    pod = lsgd_jax.HierarchicalModelAverager({2: "local", 4: ("pod", "node", "local")}, 4)
    tx = optax.chain(hook(4, post_local_gradient_allreduce=False), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"phase 1 .*HierarchicalModelAverager: mesh axis 'pod'"):
        lsgd_jax.data_parallel_step(LOSS, optax.chain(tx, lsgd_jax.model_averaging(pod)), mesh)
    # a two-level strategy whose inner axis the mesh lacks: refused before the warm-up
    two = hook(4, communication=lsgd_jax.comm.quantized(8, two_level=True, inner_axis="gpu"))
    with pytest.raises(ValueError, match="phase 0 .*inner_axis 'gpu'"):
        lsgd_jax.data_parallel_step(LOSS, optax.chain(two, optax.sgd(0.1)), mesh)


def test_the_check_traces_only_and_names_each_phase():
    from lsgd_jax.step import _preflight

    tx = optax.chain(hook(8), optax.sgd(0.1), avg(8, delay=1))
    state = tx.init({})
    words = [_preflight.describe_phase(state, k) for k in range(lsgd_jax.num_phases(state))]
    assert words[0] == ("post_local_sgd's node-local gradient mean (from step 8 on), no average")
    assert words[-1] == (
        "post_local_sgd's global gradient mean (the warm-up), an average over every data "
        "axis, a delayed average landing"
    )


def explicit_mesh():
    mesh = jax.make_mesh((2, 4), ("node", "local"))
    assert set(mesh.axis_types) == {AxisType.Explicit}  # jax.make_mesh's default
    return mesh


@pytest.mark.parametrize("lowering", ["shard_map", "jit"])
def test_a_mesh_with_explicit_axes_trains_as_an_auto_one(lowering):
    # It used to fail in shard_map: "in_specs ... does not match the specs of the input".
    tx = optax.chain(hook(2), optax.adam(0.05), avg(2))
    batch = jax.random.normal(jax.random.key(1), (16, 3))
    losses = []
    for mesh in (mesh_2x4(), explicit_mesh()):
        step = lsgd_jax.data_parallel_step(LOSS, tx, mesh, lowering=lowering)
        p, s = lsgd_jax.replicate(P0, mesh), lsgd_jax.replicate(tx.init(P0), mesh)
        run = []
        for k in range(5):
            p, s, loss = step(p, s, batch[:8] if k % 2 else batch[8:])
            run.append(float(loss))
        losses.append(run)
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)
