"""check_configuration and step_counters on flax.nnx's Optimizer (issue 33, item 9).

``nnx.state(optimizer)`` flattens optax's states into dicts, so the order check found no
hook and step_counters no counters: a wrong order passed silently. The optimizer itself
is read through (its ``opt_state``); its flattened State is refused, naming what to pass.
"""

import jax
import optax
import pytest
from flax import nnx

import lsgd_jax

MODEL = nnx.Linear(3, 2, rngs=nnx.Rngs(0))


def optimizer(tx):
    return nnx.Optimizer(MODEL, tx, wrt=nnx.Param)


def chain(wrong):
    hook = lsgd_jax.post_local_sgd(4)
    avg = lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, warmup_steps=4))
    if wrong:
        return optax.chain(optax.sgd(0.1), hook, avg)
    return optax.chain(hook, optax.sgd(0.1), avg)


def test_the_optimizer_is_read_through():
    opt = optimizer(chain(wrong=True))
    for given in (opt, opt.opt_state):
        with pytest.raises(ValueError, match="post_local_sgd must come first"):
            lsgd_jax.check_configuration(given)
    right = optimizer(chain(wrong=False))
    lsgd_jax.check_configuration(right)
    assert list(lsgd_jax.step_counters(right)) == ["[0].iter", "[2].step"]
    assert [s.averager.period for s in lsgd_jax.averager_states(right)] == [2]


def test_its_flattened_state_is_refused_with_what_to_pass():
    opt = optimizer(chain(wrong=True))
    for check in (lsgd_jax.check_configuration, lsgd_jax.step_counters):
        with pytest.raises(TypeError, match=r"nnx.state\(optimizer\).*optimizer.opt_state"):
            check(nnx.state(opt))
    # a model's own state holds no optimizer: nothing to find, no error
    assert lsgd_jax.step_counters(nnx.state(MODEL)) == {}


def test_an_optimizer_inside_a_container_is_read_through_too():
    bad = optimizer(chain(wrong=True))
    for tree in ({"o": bad}, [bad], (1.0, bad)):
        with pytest.raises(ValueError, match="post_local_sgd must come first"):
            lsgd_jax.check_configuration(tree)


def test_its_counters_are_arrays():
    counters = lsgd_jax.step_counters(optimizer(chain(wrong=False)))
    assert all(isinstance(c, jax.Array) and int(c) == 0 for c in counters.values())
