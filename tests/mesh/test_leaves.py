"""A whole model object through replicate and tx.init (issue 33, items 10 and 12).

An Equinox module holds its params beside functions (an activation) and settings (a
dropout rate, an ``inference`` flag). Before: ``replicate`` failed with "Dtype object is
not a valid JAX array type" and ``tx.init`` with "zeros_like requires ndarray" (no leaf
named); a Python bool or float was silently replicated into an array of 8 and failed in
``jax.grad`` ("got bool"); an integer array kept by ``eqx.is_array`` failed there with
no hint. Now each is named, with the fix, before the first step.
"""

import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lsgd_jax

PARTITION = "eqx.partition(model, eqx.is_inexact_array)"


@pytest.fixture(scope="module")
def mesh():
    return lsgd_jax.make_mesh(2, 4)


def chain(hook=True):
    parts = [optax.sgd(0.1, momentum=0.9)]
    if hook:
        parts.insert(0, lsgd_jax.post_local_sgd(4))
    avg = lsgd_jax.PeriodicModelAverager(2, warmup_steps=4)
    return optax.chain(*parts, lsgd_jax.model_averaging(avg))


class WithBuffer(eqx.Module):
    linear: eqx.nn.Linear
    positions: jax.Array  # an integer buffer: eqx.is_array keeps it, jax.grad refuses it

    def __init__(self, key):
        self.linear = eqx.nn.Linear(3, 2, key=key)
        self.positions = jnp.arange(3)


def test_a_function_leaf_is_named_by_replicate(mesh):
    model = eqx.nn.MLP(4, 1, 8, 1, key=jax.random.key(0))
    with pytest.raises(TypeError) as e:
        lsgd_jax.replicate(model, mesh)
    message = str(e.value)
    assert message.startswith("replicate: leaf .activation is ")
    assert "not an array" in message and PARTITION in message and "eqx.combine" in message


def test_a_function_leaf_is_named_by_tx_init_in_the_hook_and_in_the_averager():
    model = eqx.nn.MLP(4, 1, 8, 1, key=jax.random.key(0))
    with pytest.raises(TypeError, match=r"^post_local_sgd: init\(params\): leaf \.activation"):
        chain().init(model)
    # without the hook (DDP's chain), plain SGD's init touches no leaf: the averager names it
    ddp = optax.chain(optax.sgd(0.1), lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2)))
    with pytest.raises(TypeError, match=r"^PeriodicModelAverager: init\(params\): leaf \.activ"):
        ddp.init(model)


def test_dropout_flags_are_refused_and_its_rate_named(mesh):
    drop = eqx.nn.Dropout(0.1)  # leaves: .p (a Python float), .inference (a Python bool)
    with pytest.raises(TypeError, match=r"leaf \.inference is the Python bool False"):
        lsgd_jax.replicate(drop, mesh)
    with pytest.raises(TypeError, match=r"leaf \.inference is the Python bool False"):
        chain().init(drop)
    with pytest.raises(TypeError, match=r"PeriodicModelAverager: init\(params\): leaf \.infer"):
        lsgd_jax.PeriodicModelAverager(2).init(drop)
    # a Python float is a value in plain JAX: replicated as before, with a warning naming it
    with pytest.warns(UserWarning) as caught:
        rep = lsgd_jax.replicate({"w": jnp.ones(2), "p": 0.1}, mesh)
    (message,) = [str(w.message) for w in caught]
    assert message.startswith(
        "replicate: leaf ['p'] is a Python float (0.1): replicated, it is an array of 8 "
        "float32 copies"
    )
    assert "jnp.asarray(0.1)" in message and PARTITION in message
    np.testing.assert_allclose(rep["p"], np.full(8, 0.1, np.float32))
    with warnings.catch_warnings():  # said as an array: no warning
        warnings.simplefilter("error")
        lsgd_jax.replicate({"w": jnp.ones(2), "p": jnp.asarray(0.1)}, mesh)
        lsgd_jax.replicate({"count": np.int32(3), "mask": jnp.ones(2, bool)}, mesh)


def test_an_integer_array_kept_by_is_array_is_named_with_the_hint(mesh):
    # The optimizer takes integer leaves (optax's own transforms do; the averager keeps
    # their values): the step, which differentiates the params, names the leaf before
    # its first call runs, where jax.grad said only "got int32".
    params, _ = eqx.partition(WithBuffer(jax.random.key(0)), eqx.is_array)
    tx = chain()
    state = tx.init(params)
    step = lsgd_jax.data_parallel_step(lambda p, b: jnp.sum(p.linear.weight), tx, mesh)
    p, s = lsgd_jax.replicate(params, mesh), lsgd_jax.replicate(state, mesh)
    with pytest.raises(TypeError) as e:
        step(p, s, {"x": jnp.ones((8, 3))})
    message = str(e.value)
    assert message.startswith(
        "data_parallel_step: leaf .positions is an int32 array of shape (8, 3)"
    )
    assert "eqx.is_inexact_array, not eqx.is_array" in message
    with pytest.raises(TypeError, match="leaf .positions is an int32 array of shape .3,."):
        lsgd_jax.data_parallel_step(lambda p, b: 0.0, tx, mesh, example_params=params)


def test_the_partitioned_model_goes_through_every_door(mesh):
    model = WithBuffer(jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    tx = chain()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        p, s = lsgd_jax.replicate(params, mesh), lsgd_jax.replicate(tx.init(params), mesh)
    assert p.positions is None and p.linear.weight.shape == (8, 2, 3)

    def loss(params, batch):
        net = eqx.combine(params, static)
        return jnp.mean((jax.vmap(net.linear)(batch["x"]) - batch["y"]) ** 2)

    step = lsgd_jax.data_parallel_step(loss, tx, mesh)
    batch = {"x": jnp.ones((16, 3)), "y": jnp.zeros((16, 2))}
    p, s, value = step(p, s, batch)
    assert np.isfinite(float(value))
    assert lsgd_jax.consensus(p).linear.weight.shape == (2, 3)


def test_replicate_names_the_mesh_argument():
    # Before: AttributeError: 'NoneType' object has no attribute 'axis_names'
    with pytest.raises(
        TypeError, match=re.escape("replicate: mesh must be a jax.sharding.Mesh, got None")
    ):
        lsgd_jax.replicate({"w": jnp.ones(2)}, None)
