"""The build check runs on the user's own model, never on a stand-in (issue 33, items 1-3).

A check that depends on the model's shapes (streaming fragments need enough values to
split) runs on the real params' abstract shapes: at the first call, before any step runs,
or when the step is built from ``example_params=``. A check that re-raises keeps the
library's own exception class, and a transformation whose state is a bare array does not
switch the order check off.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh_2x4

import lsgd_jax

# 498 floating values in 8 leaves of mixed shapes.
SHAPES = {"a": (7,), "b": (3, 5), "c": (2, 3, 4), "d": (), "e": (100,), "f": (10, 10),
          "g": (4, 4, 4), "h": (17, 11)}  # fmt: skip


def model():
    keys = jax.random.split(jax.random.key(0), len(SHAPES))
    params = {k: jax.random.normal(key, s) for key, (k, s) in zip(keys, SHAPES.items())}
    return params


def n_values(params):
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def loss_fn(params, batch):
    leaves = jax.tree.leaves(params)
    return sum(jnp.mean((jnp.ravel(x) - batch.mean()) ** 2) for x in leaves)


def chain(fragments, start=2, period=4):
    averager = lsgd_jax.PeriodicModelAverager(period, warmup_steps=start, fragments=fragments)
    return optax.chain(
        lsgd_jax.post_local_sgd(start, post_local_gradient_allreduce=False),
        optax.sgd(0.05),
        lsgd_jax.model_averaging(averager),
    )


def batches(steps):
    # replica r's rows hold r + step: every replica moves its own way
    return [jnp.repeat(jnp.arange(8.0) + s, 2)[:, None] * jnp.ones((16, 3)) for s in range(steps)]


def equal_across_replicas(params):
    """Flat mask of the values that every replica holds alike (the mean lands through
    ``apply_updates``, so within float rounding); the others must differ clearly."""
    flat = np.concatenate([np.asarray(x).reshape(8, -1) for x in jax.tree.leaves(params)], 1)
    spread = flat.max(0) - flat.min(0)
    equal = spread <= 1e-6 * (1 + np.abs(flat).max(0))
    assert np.all(equal | (spread > 1e-4)), "neither averaged nor clearly apart"
    return equal


def fragment_mask(total, k, count):
    chunk = -(-total // count)
    mask = np.zeros(total, bool)
    mask[k * chunk : (k + 1) * chunk] = True
    return mask


@pytest.mark.parametrize("fragments", [3, 4, 8])
@pytest.mark.parametrize("check_order", [True, False])
def test_streaming_fragments_build_and_average_one_slice_at_a_time(fragments, check_order):
    mesh, params0 = mesh_2x4(), model()
    period = 2 * fragments
    tx = chain(fragments, period=period)
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, check_order=check_order)
    p, s = lsgd_jax.replicate(params0, mesh), lsgd_jax.replicate(tx.init(params0), mesh)
    total = n_values(params0)
    averager = tx.init(params0)[2].averager
    seen = set()
    for k, batch in enumerate(batches(2 + period)):
        p, s, _ = step(p, s, batch)
        level = int(averager.level(k))
        equal = equal_across_replicas(p)
        if level:
            seen.add(level)
            want = fragment_mask(total, level - 1, fragments)
            np.testing.assert_array_equal(equal, want)
    assert seen == set(range(1, fragments + 1))


@pytest.mark.parametrize("fragments", [3, 4, 8])
def test_streaming_fragments_through_stacked(fragments):
    mesh, params0 = mesh_2x4(), model()
    tx = lsgd_jax.stacked(chain(fragments, period=fragments), mesh)
    p = lsgd_jax.replicate(params0, mesh)
    s = tx.init(p)

    @jax.jit
    def train(p, s, batch):
        grads = jax.vmap(jax.grad(loss_fn))(p, batch.reshape(8, 2, 3))
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    total = n_values(params0)
    for batch in batches(3):
        p, s = train(p, s, batch)
    # step 2 (the switch) averaged fragment 1
    want = fragment_mask(total, 0, fragments)
    np.testing.assert_array_equal(equal_across_replicas(p), want)


def test_a_model_too_small_for_its_fragments_is_refused_before_the_first_step():
    mesh = mesh_2x4()
    tiny = {"w": jnp.ones((3,))}
    tx = chain(4)
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh)  # the build can't know yet
    p, s = lsgd_jax.replicate(tiny, mesh), lsgd_jax.replicate(tx.init(tiny), mesh)
    with pytest.raises(ValueError, match=r"fragments=4 needs at least that many .* got 3"):
        step(p, s, batches(1)[0])
    # nothing ran: the state is as it was (the counters at 0)
    assert [int(np.max(c)) for c in lsgd_jax.step_counters(s).values()] == [0, 0]
    # with example_params the build itself refuses
    with pytest.raises(ValueError, match=r"fragments=4 needs at least that many"):
        lsgd_jax.data_parallel_step(loss_fn, tx, mesh, example_params=tiny)
    with pytest.raises(ValueError, match=r"fragments=4 needs at least that many"):
        lsgd_jax.stacked(tx, mesh).init(lsgd_jax.replicate(tiny, mesh))


def test_example_params_checks_the_real_model_when_the_step_is_built():
    mesh, params0 = mesh_2x4(), model()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params0)
    for example in (params0, abstract):
        step = lsgd_jax.data_parallel_step(loss_fn, chain(4), mesh, example_params=example)
        tx = chain(4)
        p, s = lsgd_jax.replicate(params0, mesh), lsgd_jax.replicate(tx.init(params0), mesh)
        p, s, loss = step(p, s, batches(1)[0])
        assert np.isfinite(float(loss))
    with pytest.raises(TypeError, match="example_params"):
        lsgd_jax.data_parallel_step(loss_fn, chain(4), mesh, example_params="params")


def test_an_unbound_axis_keeps_the_librarys_exception_class():
    # The build check used to re-raise it as a plain ValueError: `except
    # lsgd_jax.AxisNotBoundError` stopped catching it.
    mesh = mesh_2x4()
    pod = lsgd_jax.HierarchicalModelAverager({2: "local", 4: ("pod", "node", "local")}, 4)
    tx = optax.chain(
        lsgd_jax.post_local_sgd(4, post_local_gradient_allreduce=False),
        optax.sgd(0.1),
        lsgd_jax.model_averaging(pod),
    )
    for build in (
        lambda: lsgd_jax.data_parallel_step(loss_fn, tx, mesh),
        lambda: lsgd_jax.stacked(tx, mesh),
    ):
        with pytest.raises(lsgd_jax.AxisNotBoundError) as e:
            build()
        assert "phase 1" in str(e.value) and "mesh axis 'pod'" in str(e.value)
        assert isinstance(e.value, ValueError)  # what the build check raised before


def bare(scale):
    """A transformation whose state is a bare array (no NamedTuple)."""

    def init(params):
        del params
        return jnp.zeros([])

    def update(updates, state, params=None):
        del params
        return jax.tree.map(lambda u: scale * u, updates), state + 1

    return optax.GradientTransformation(init, update)


def test_a_bare_array_state_does_not_switch_the_order_check_off():
    # optax.chain(hook, sgd, averaging, t) with t's state a bare array trained without a
    # word; after an averaging step the replicas still differed by 0.51.
    hook = lsgd_jax.post_local_sgd(2)
    avg = lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, warmup_steps=2))
    wrong = optax.chain(hook, optax.sgd(0.1), avg, bare(0.5))
    with pytest.raises(ValueError, match="model_averaging must come last"):
        lsgd_jax.check_configuration(wrong.init(model()))
    with pytest.raises(ValueError, match="model_averaging must come last"):
        lsgd_jax.data_parallel_step(loss_fn, wrong, mesh_2x4())
    with pytest.raises(ValueError, match="model_averaging must come last"):
        lsgd_jax.stacked(wrong, mesh_2x4())
    before = optax.chain(bare(2.0), hook, optax.sgd(0.1), avg)
    with pytest.raises(ValueError, match="post_local_sgd must come first"):
        lsgd_jax.check_configuration(before.init(model()))
    # in the right place it is a gradient transform like any other
    right = optax.chain(hook, bare(0.5), optax.sgd(0.1), avg)
    lsgd_jax.check_configuration(right.init(model()))
    lsgd_jax.data_parallel_step(loss_fn, right, mesh_2x4())


def test_a_bare_array_state_after_a_nested_chain_is_refused_with_the_optimizer_known():
    # chain(chain(hook, sgd, averaging), t) is, as a state, (inner, t's array): shaped
    # like a wrapper's own (inner, count). Given the optimizer, the check reads which
    # tuples are optax.chain's from it.
    hook = lsgd_jax.post_local_sgd(2)
    avg = lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, warmup_steps=2))
    for t in (bare(0.5), optax.GradientTransformation(lambda p: 0, lambda u, s, p=None: (u, s))):
        wrong = optax.chain(optax.chain(hook, optax.sgd(0.1), avg), t)
        with pytest.raises(ValueError, match="model_averaging must come last"):
            lsgd_jax.check_configuration(wrong.init(model()), tx=wrong)
        with pytest.raises(ValueError, match=r"position 0 of chain\(chain\("):
            lsgd_jax.data_parallel_step(loss_fn, wrong, mesh_2x4())
        with pytest.raises(ValueError, match="model_averaging must come last"):
            lsgd_jax.stacked(wrong, mesh_2x4())
    named = optax.named_chain(("inner", optax.chain(hook, optax.sgd(0.1), avg)), ("t", bare(2.0)))
    with pytest.raises(ValueError, match="model_averaging must come last"):
        lsgd_jax.check_configuration(named.init(model()))


def test_example_params_do_not_stand_in_for_the_first_calls_own_arguments():
    # Built from example_params, the first call skipped its own checks: swapped
    # arguments or a smaller model met jax's raw errors, without the step's name.
    mesh, params0 = mesh_2x4(), model()
    tx = chain(8, period=8)
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, example_params=params0)
    p, s = lsgd_jax.replicate(params0, mesh), lsgd_jax.replicate(tx.init(params0), mesh)
    with pytest.raises(TypeError, match=r"data_parallel_step: leaf \[0\]\.iter is an int32"):
        step(s, p, batches(1)[0])  # the optimizer state where the params go
    tiny = {"w": jnp.ones((5,))}
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, example_params=params0)
    p, s = lsgd_jax.replicate(tiny, mesh), lsgd_jax.replicate(tx.init(tiny), mesh)
    with pytest.raises(lsgd_jax.step.ModelShapeError, match=r"data_parallel_step: .* phase"):
        step(p, s, batches(1)[0])


def test_example_params_take_what_replicate_takes_and_name_the_rest():
    mesh = mesh_2x4()
    tx = chain(1)
    lsgd_jax.data_parallel_step(loss_fn, tx, mesh, example_params={"w": jnp.ones(3), "b": 0.5})
    with pytest.raises(TypeError, match=r"example_params: leaf \['flag'\] is the Python bool"):
        lsgd_jax.data_parallel_step(
            loss_fn, tx, mesh, example_params={"w": jnp.ones(3), "flag": True}
        )


def test_an_axis_the_mesh_lacks_is_an_axis_not_bound_error_in_the_phase_that_needs_it():
    from jax.sharding import AxisType, Mesh

    one_axis = Mesh(np.array(jax.devices()), ("batch",), axis_types=(AxisType.Auto,))
    tx = optax.chain(lsgd_jax.post_local_sgd(2), optax.sgd(0.1))
    with pytest.raises(lsgd_jax.AxisNotBoundError, match="phase 0 .*node-local gradient mean"):
        lsgd_jax.data_parallel_step(loss_fn, tx, one_axis)
    typo = lsgd_jax.PeriodicModelAverager(2, warmup_steps=2, process_group="nodes")
    tx = optax.chain(lsgd_jax.post_local_sgd(2), optax.sgd(0.1), lsgd_jax.model_averaging(typo))
    with pytest.raises(lsgd_jax.AxisNotBoundError) as e:
        lsgd_jax.data_parallel_step(loss_fn, tx, mesh_2x4())
    assert "in phase 1 (" in str(e.value) and "an average over ('nodes',)" in str(e.value)
