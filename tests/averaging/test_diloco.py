"""averaging.diloco_outer: DiLoCo's outer Nesterov step cooling down into a plain average
(issue 29's slow-link recipe); its replay through an averager is in tests/spec."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import DATA, mesh_2x4, put, smap, squeeze, unsqueeze

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
    # 10 averages, the first plain (outer_skip_first): 9 updates, the last ceil(0.4 * 9)
    # = 4 ramp, at 1/4, 2/4, 3/4 and 4/4 of the way to (1, 0)
    tx = diloco_outer(10, 0.7, 0.9, cooldown=0.4)
    lr, m = np.array(hyperparams_of_each_update(tx, 11)).T
    np.testing.assert_allclose(lr[:5], 0.7, rtol=1e-6)
    np.testing.assert_allclose(lr[4:9], [0.7, 0.775, 0.85, 0.925, 1.0], rtol=1e-6)
    np.testing.assert_allclose(m[4:9], [0.9, 0.675, 0.45, 0.225, 0.0], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(lr[8:], 1.0)
    np.testing.assert_array_equal(m[8:], 0.0)


def test_no_cooldown_is_plain_optax_sgd():
    tx = diloco_outer(10, 0.7, 0.9, cooldown=0)
    ref = optax.sgd(0.7, momentum=0.9, nesterov=True)
    s, r = tx.init(jnp.zeros(2)), ref.init(jnp.zeros(2))
    for g in (1.0, -2.0, 0.5):
        u, s = tx.update(jnp.full(2, g), s)
        v, r = ref.update(jnp.full(2, g), r)
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"momentum": 1.0}, ValueError, r"momentum must be a number in \[0, 1\), got 1.0"),
        ({"cooldown": 1.5}, ValueError, r"cooldown must be a number in \[0, 1\], got 1.5"),
        ({"learning_rate": 0}, ValueError, "learning_rate must be positive, got 0; e.g. learn"),
        ({"learning_rate": True}, TypeError, "learning_rate must be a real number, got True"),
        ({"cooldown": "0.3"}, TypeError, "cooldown must be a real number, got '0.3'"),
        ({"outer_skip_first": 1}, TypeError, "outer_skip_first must be True or False, got 1"),
    ],
)
def test_bad_values_name_themselves(kwargs, error, message):
    with pytest.raises(error, match=f"diloco_outer: {message}"):
        diloco_outer(10, **kwargs)


def test_it_is_an_averagers_outer_optimizer_and_in_the_namespace():
    outer = diloco_outer(num_outer_steps(40, 8, 4), cooldown=0.3)
    averager = lsgd_jax.PeriodicModelAverager(4, warmup_steps=8, outer_optimizer=outer)
    assert averager.parts.then.optimizer is outer
    assert {"diloco_outer", "num_outer_steps"} <= set(lsgd_jax.averaging.__all__)


# --- the cool-down ends at the run's last outer update ----------------------------------


def replay_hyperparams(averages, lr, momentum, cooldown, skip_first=True):
    """The (learning rate, momentum) of each update the outer optimizer performs, from
    diloco_outer's docstring alone, in plain Python: ``averages`` global averages, the
    first of which does not reach the optimizer with ``skip_first``; the last
    ``ceil(cooldown * updates)`` updates ramp linearly, the last at (1, 0)."""
    updates = averages - 1 if skip_first else averages
    cooled = math.ceil(round(cooldown * updates, 6))
    out = []
    for k in range(updates):
        ramp = max(0, k - (updates - cooled) + 1) / cooled if cooled else 0.0
        out.append((lr + (1 - lr) * ramp, momentum * (1 - ramp)))
    return out


def test_the_replay_states_the_documented_numbers():
    # the slow-link recipe: 1500 steps, switch 100, H=32: 44 averages, 43 outer updates,
    # the last ceil(0.3 * 43) = 13 cooled; the last at (1, 0), the one before at 12/13
    recipe = replay_hyperparams(num_outer_steps(1500, 100, 32), 0.7, 0.8, 0.3)
    assert len(recipe) == 43
    assert recipe[29] == (0.7, 0.8)
    np.testing.assert_allclose(recipe[30], (0.7 + 0.3 / 13, 0.8 * 12 / 13))
    np.testing.assert_allclose(recipe[41], (0.7 + 0.3 * 12 / 13, 0.8 / 13))
    assert recipe[42] == (1.0, 0.0)
    # 20 steps, switch 2, H=3: 6 averages, 5 updates, ceil(0.3 * 5) = 2 cooled
    short = replay_hyperparams(num_outer_steps(20, 2, 3), 0.7, 0.9, 0.3)
    np.testing.assert_allclose(short, [(0.7, 0.9)] * 3 + [(0.85, 0.45), (1.0, 0.0)])


def hyperparams_of_each_update(tx, updates):
    state = tx.init(jnp.zeros(1))
    seen = []  # what update k applied (inject_hyperparams keeps it in the state)
    for _ in range(updates):
        _, state = tx.update(jnp.ones(1), state)
        hyper = state.hyperparams
        seen.append((float(hyper["learning_rate"]), float(hyper["momentum"])))
    return seen


@pytest.mark.parametrize(
    ("averages", "lr", "momentum", "cooldown", "skip_first"),
    [
        (44, 0.7, 0.8, 0.3, True),  # the slow-link recipe
        (57, 0.7, 0.9, 0.3, True),
        (6, 0.7, 0.9, 0.3, True),  # a 20-step run
        (6, 0.7, 0.9, 0.3, False),
        (11, 0.5, 0.9, 0.3, True),  # 0.3 * 10 updates: 3 cooled, not 4
        (2, 0.7, 0.9, 0.3, True),  # one update: it is the plain average
        (10, 0.7, 0.9, 1.0, False),  # the whole run cools
        (5, 1.3, 0.5, 0.01, True),
    ],
)
def test_each_outer_update_runs_at_the_replayed_values(
    averages, lr, momentum, cooldown, skip_first
):
    options = {} if skip_first else {"outer_skip_first": False}  # True: the default
    tx = diloco_outer(averages, lr, momentum, cooldown=cooldown, **options)
    want = replay_hyperparams(averages, lr, momentum, cooldown, skip_first)
    got = hyperparams_of_each_update(tx, len(want) + 2)
    np.testing.assert_allclose(got[: len(want)], want, rtol=1e-6, atol=1e-7)
    assert got[len(want) - 1] == (1.0, 0.0)  # exactly: the update is the average itself
    assert got[len(want) :] == [(1.0, 0.0)] * 2  # past the run: still a plain average


def test_the_last_update_applies_the_averaged_change_exactly():
    tx = diloco_outer(6, 0.7, 0.9, cooldown=0.3)  # 5 updates
    state = tx.init(jnp.zeros(3))
    for g in (1.0, -2.0, 0.5, 4.0):
        _, state = tx.update(jnp.full(3, g), state)
    change = jnp.array([0.1, -3.0, 7.25])
    update, _ = tx.update(change, state)
    np.testing.assert_array_equal(np.asarray(update), -np.asarray(change))


# --- through an averager, 8 replicas -----------------------------------------------------


def replay_run(increments, warmup, period, hyper, skip_first):
    """NumPy (float64) replay of the replicas' params through PeriodicModelAverager with
    an outer Nesterov step at each global average after the first: ``(params after each
    step, the steps that averaged)``."""
    x = np.zeros((increments.shape[0],) + increments.shape[2:])
    anchor = np.zeros(increments.shape[2:])
    trace = np.zeros_like(anchor)
    averaged, after, k = [], [], 0
    for t in range(increments.shape[1]):
        x = x + increments[:, t]
        if t >= warmup and (t - warmup) % period == 0:
            mean = x.mean(0)
            if skip_first and not averaged:
                new = mean
            else:
                lr, m = hyper[k]
                g = anchor - mean
                trace = g + m * trace
                new = anchor - lr * (g + m * trace)
                k += 1
            x, anchor = np.broadcast_to(new, x.shape).copy(), new
            averaged.append(t)
        after.append(x)
    assert k == len(hyper)
    return np.stack(after, 1), averaged


def run_averager(averager, increments):
    """The library: each step adds this replica's increment, then averages; returns the
    params before and after each averaging call and the outer optimizer's (lr, m) after
    it, stacked over the steps (leading axis: the 8 replicas)."""
    mesh = mesh_2x4()

    def body(incs, state):
        incs, state = squeeze((incs, state))

        def step(carry, inc):
            p, s = carry
            before = p + inc
            after, s = averager.average_parameters(before, s)
            hyper = s.outer_state.hyperparams
            return (after, s), (before, after, hyper["learning_rate"], hyper["momentum"])

        p0 = jnp.zeros_like(incs[0])  # per replica (varying over the data axes)
        (_, state), seen = jax.lax.scan(step, (p0, state), incs)
        return unsqueeze((seen, state))

    f = smap(body, mesh, (DATA, DATA), (DATA, DATA))
    state = lsgd_jax.replicate(averager.init(jnp.zeros(increments.shape[2:])), mesh)
    seen, state = f(put(jnp.asarray(increments), mesh, DATA), state)
    return jax.tree.map(np.asarray, seen), state


@pytest.mark.parametrize(
    ("steps", "warmup", "period", "lr", "momentum", "skip_first"),
    [
        (1500, 100, 32, 0.7, 0.8, True),  # the slow-link recipe: 44 averages
        (20, 2, 3, 0.7, 0.9, True),  # 6 averages
        (20, 2, 3, 0.7, 0.9, False),
    ],
)
def test_the_runs_last_outer_step_is_the_plain_average(
    steps, warmup, period, lr, momentum, skip_first
):
    averages = num_outer_steps(steps, warmup, period)
    options = {} if skip_first else {"outer_skip_first": False}  # True: the default
    outer = diloco_outer(averages, lr, momentum, cooldown=0.3, **options)
    averager = lsgd_jax.PeriodicModelAverager(
        period, warmup, outer_optimizer=outer, outer_skip_first=skip_first
    )
    rng = np.random.default_rng(steps)
    increments = (rng.standard_normal((8, steps, 3)) * 0.01).astype(np.float32)
    (before, after, lr_seen, m_seen), state = run_averager(averager, increments)

    hyper = replay_hyperparams(averages, lr, momentum, 0.3, skip_first)
    want, averaged = replay_run(increments.astype(np.float64), warmup, period, hyper, skip_first)
    assert len(averaged) == averages and averaged[-1] < steps
    assert np.asarray(state.outer_state.count)[0] == len(hyper)
    # the (lr, momentum) each outer update ran at, as the replay says
    stepped = averaged[1:] if skip_first else averaged
    got = np.stack([lr_seen[0, stepped], m_seen[0, stepped]], 1)
    np.testing.assert_allclose(got, hyper, rtol=1e-6, atol=1e-7)
    # the params along the run, as the replay says
    np.testing.assert_allclose(after, want, rtol=1e-4, atol=1e-5)
    # the last outer step applies the replicas' mean as it is
    last = averaged[-1]
    mean = before[:, last].astype(np.float64).mean(0)
    np.testing.assert_allclose(after[:, last], np.broadcast_to(mean, (8, 3)), rtol=1e-6, atol=1e-7)
    assert (after[:, last] == after[0, last]).all()  # the replicas agree bitwise
    # ... and the one before did not (it still had momentum), so the check means something
    before_last = averaged[-2]
    assert not np.allclose(after[0, before_last], before[:, before_last].mean(0), atol=1e-6)


# --- the averager checks diloco_outer's outer_skip_first ---------------------------------


@pytest.mark.parametrize("kind", ["periodic", "hierarchical"])
@pytest.mark.parametrize("skip_first", [True, False])
def test_an_averager_refuses_a_diloco_outer_built_for_the_other_outer_skip_first(kind, skip_first):
    # issue 33: averager True, diloco_outer False ran the run's last outer update at
    # lr 0.850, momentum 0.400 (20 steps, switch 2, H=3), not the plain average (1, 0)
    outer = diloco_outer(num_outer_steps(20, 2, 3), outer_skip_first=not skip_first)
    assert outer.outer_skip_first is (not skip_first)

    def build(**options):
        if kind == "periodic":
            return lsgd_jax.PeriodicModelAverager(3, warmup_steps=2, **options)
        return lsgd_jax.HierarchicalModelAverager({3: ("node", "local")}, **options)

    words = (
        f"outer_skip_first={skip_first} here, but the outer_optimizer was built with "
        f"diloco_outer\\(..., outer_skip_first={not skip_first}\\).*e.g. diloco_outer"
        f"\\(..., outer_skip_first={skip_first}\\)"
    )
    with pytest.raises(ValueError, match=words):
        build(outer_optimizer=outer, outer_skip_first=skip_first)
    # the same value: accepted, equal and hashable as averagers are
    same = diloco_outer(num_outer_steps(20, 2, 3), outer_skip_first=skip_first)
    a = build(outer_optimizer=same, outer_skip_first=skip_first)
    assert a == build(outer_optimizer=same, outer_skip_first=skip_first)
    assert hash(a) == hash(build(outer_optimizer=same, outer_skip_first=skip_first))
    assert isinstance(same, optax.GradientTransformationExtraArgs)
    # no cool-down: a constant optax.sgd, whatever the averager counts
    build(
        outer_optimizer=diloco_outer(6, cooldown=0, outer_skip_first=not skip_first),
        outer_skip_first=skip_first,
    )


def test_the_last_update_is_the_plain_average_once_the_values_match():
    # the probe's run with matching values: the last outer update at (1, 0)
    mesh = mesh_2x4()
    outer = diloco_outer(num_outer_steps(20, 2, 3), 0.7, 0.8, cooldown=0.3)
    avg = lsgd_jax.PeriodicModelAverager(3, warmup_steps=2, outer_optimizer=outer)
    tx = optax.chain(lsgd_jax.post_local_sgd(2), optax.sgd(0.1), lsgd_jax.model_averaging(avg))
    params = {"w": jnp.ones(4)}

    def loss_fn(p, b):
        return jnp.sum(p["w"] * b.mean(0)) + jnp.sum(p["w"] ** 2)

    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, example_params=params)
    p, s = lsgd_jax.replicate(params, mesh), lsgd_jax.replicate(tx.init(params), mesh)
    for _ in range(20):
        p, s, _ = step(p, s, jnp.arange(64.0).reshape(16, 4) / 64)
    hyper = lsgd_jax.averager_states(s)[0].outer_state.hyperparams
    assert float(hyper["learning_rate"][0]) == 1.0 and float(hyper["momentum"][0]) == 0.0
