"""averaging.diloco_outer: DiLoCo's outer Nesterov step cooling down into a plain average
(issue 29's slow-link recipe); its replay through an averager is in tests/spec."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lsgd_jax
from lsgd_jax.averaging import diloco_outer, num_outer_steps


def test_num_outer_steps_counts_the_switch_and_every_period_after_it():
    assert num_outer_steps(1500, 150, 24) == 57  # 150, 174, ..., 1494
    assert len(range(150, 1500, 24)) == 57
    assert num_outer_steps(10, 10, 4) == 1  # at least one
    # a callable period: the schedule replayed (averages at 150, ..., 1182, then 1200, 1212, ...)
    shrinking = lambda s: jnp.where(s < 1200, 24, 12)  # noqa: E731
    assert num_outer_steps(1500, 150, shrinking) == 44 + 25
    assert num_outer_steps(1500, 150, lambda s: 24 + 0 * s) == 57
    with pytest.raises(ValueError, match="period must be a positive int, got 0"):
        num_outer_steps(100, 10, 0)


def test_the_cooldown_ramps_from_nesterov_to_a_plain_average():
    tx = diloco_outer(10, 0.7, 0.9, cooldown=0.4)  # updates 6..10 ramp, 4 long
    state = tx.init(jnp.zeros(1))
    seen = []  # what update k applied (inject_hyperparams keeps it in the state)
    for _ in range(12):
        _, state = tx.update(jnp.ones(1), state)
        hyper = state.hyperparams
        seen.append((float(hyper["learning_rate"]), float(hyper["momentum"])))
    lr, m = np.array(seen).T
    np.testing.assert_allclose(lr[:7], 0.7, rtol=1e-6)
    np.testing.assert_allclose(lr[6:11], [0.7, 0.775, 0.85, 0.925, 1.0], rtol=1e-6)
    np.testing.assert_allclose(m[6:11], [0.9, 0.675, 0.45, 0.225, 0.0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(lr[10:], 1.0)
    np.testing.assert_allclose(m[10:], 0.0, atol=1e-7)
    # past the ramp the step applies the averaged change once, whatever the momentum held
    update, _ = tx.update(jnp.full(1, 3.0), state)
    np.testing.assert_allclose(np.asarray(update), [-3.0])


def test_no_cooldown_is_plain_optax_sgd():
    tx = diloco_outer(10, 0.7, 0.9, cooldown=0)
    ref = optax.sgd(0.7, momentum=0.9, nesterov=True)
    s, r = tx.init(jnp.zeros(2)), ref.init(jnp.zeros(2))
    for g in (1.0, -2.0, 0.5):
        u, s = tx.update(jnp.full(2, g), s)
        v, r = ref.update(jnp.full(2, g), r)
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"momentum": 1.0}, r"momentum must be a number in \[0, 1\), got 1.0"),
        ({"cooldown": 1.5}, r"cooldown must be a number in \[0, 1\], got 1.5"),
        ({"learning_rate": 0}, "learning_rate must be positive, got 0"),
        ({"learning_rate": True}, "learning_rate must be positive, got True"),
        ({"cooldown": "0.3"}, "cooldown must be a number in"),
    ],
)
def test_bad_values_name_themselves(kwargs, message):
    with pytest.raises(ValueError, match=message):
        diloco_outer(10, **kwargs)


def test_it_is_an_averagers_outer_optimizer_and_in_the_namespace():
    outer = diloco_outer(num_outer_steps(40, 8, 4), cooldown=0.3)
    averager = lsgd_jax.PeriodicModelAverager(4, warmup_steps=8, outer_optimizer=outer)
    assert averager.parts.then.optimizer is outer
    assert {"diloco_outer", "num_outer_steps"} <= set(lsgd_jax.averaging.__all__)
