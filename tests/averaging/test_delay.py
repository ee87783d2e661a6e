"""delay=tau: a global average lands tau calls after it starts, as params + (mean - s);
against a plain NumPy replay of the rule."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import DATA, mesh_2x4, put, smap, squeeze, unsqueeze

import lsgd_jax

# the slow tier: 38 s on 2 workers (2026-12-01)
pytestmark = pytest.mark.slow

GLOBAL = ("node", "local")
R = 8


def noise(steps, shape=(6,), seed=0):
    return np.random.default_rng(seed).standard_normal((steps, R, *shape)).astype(np.float32)


def run_library(averager, steps, p0):
    """Each call: params += this step's noise, then average_parameters (per-replica state)."""
    mesh = mesh_2x4()

    def body(params, state, dx):
        p, s = averager.average_parameters(squeeze(params) + squeeze(dx), squeeze(state))
        return unsqueeze(p), unsqueeze(s)

    f = smap(body, mesh, (DATA, DATA, DATA), (DATA, DATA))
    params = lsgd_jax.replicate(p0, mesh)
    state = lsgd_jax.replicate(averager.init(p0), mesh)
    out = []
    for dx in noise(steps, p0.shape):
        params, state = f(params, state, put(jnp.asarray(dx), mesh, DATA))
        out.append(np.asarray(params))
    return out, state


def group_mean(x, group_size):
    blocks = x.reshape(R // group_size, group_size, *x.shape[1:]).astype(np.float64)
    mean = blocks.mean(1, keepdims=True)
    return np.broadcast_to(mean, blocks.shape).reshape(x.shape)


def replay(steps, p0, *, period, warmup, delay, levels=None, outer=None, fragments=1):
    """The rule, written out: ``levels`` maps a hierarchy's periods to group sizes (the
    last is the global one); otherwise a periodic averager (with fragments)."""
    params = np.broadcast_to(p0, (R, *p0.shape)).astype(np.float64).copy()
    start = mean = None
    anchor, trace, count = np.asarray(p0, np.float64), np.zeros(p0.shape), 0
    stride = period // fragments
    chunk = -(-p0.size // fragments)
    out = []
    for s, dx in enumerate(noise(steps, p0.shape)):
        params = params + dx
        if delay and s - delay >= warmup and _global(s - delay, warmup, stride, levels):
            params = params + (mean - start)  # the average started at s - delay lands
        level_size, positions = None, slice(None)
        if s >= warmup:
            if levels:
                hits = [p for p in levels if s % p == 0]
                level_size = levels[max(hits)] if hits else None
            elif (s - warmup) % stride == 0:
                level_size = R
                k = ((s - warmup) // stride) % fragments
                positions = slice(k * chunk, (k + 1) * chunk)
        if level_size is None:
            out.append(params.copy())
            continue
        avg = params.copy()
        avg[:, positions] = group_mean(params, level_size)[:, positions]
        if level_size == R and outer is not None:
            lr, mom = outer
            if count == 0:  # outer_skip_first: the first global average sets the anchor
                new = avg[0]
            else:
                grad = anchor - avg[0]
                trace = grad + mom * trace
                new = anchor - lr * trace
            count += 1
            anchor = new
            avg = np.broadcast_to(new, params.shape).copy()
        if level_size == R and delay:
            start, mean = params.copy(), avg  # params unchanged now
        else:
            params = avg
        out.append(params.copy())
    return out


def _global(s, warmup, stride, levels):
    if levels:
        return s % max(levels) == 0
    return (s - warmup) % stride == 0


CASES = {
    "periodic": (dict(period=4, warmup=2, delay=2), {}),
    "periodic-delay-3": (dict(period=4, warmup=0, delay=3), {}),
    "fragments": (dict(period=4, warmup=1, delay=1, fragments=2), {"fragments": 2}),
    "outer": (dict(period=3, warmup=2, delay=2, outer=(0.7, 0.9)), {}),
    "hierarchical": (dict(period=6, warmup=2, delay=3, levels={2: 4, 6: R}), {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_delay_matches_the_numpy_replay(case):
    rule, extra = CASES[case]
    steps, p0 = 19, np.linspace(-1, 1, 6).astype(np.float32)
    if rule.get("levels"):
        averager = lsgd_jax.HierarchicalModelAverager(
            {2: "local", 6: GLOBAL}, warmup_steps=rule["warmup"], delay=rule["delay"]
        )
    else:
        outer = rule.get("outer")
        averager = lsgd_jax.PeriodicModelAverager(
            rule["period"],
            rule["warmup"],
            delay=rule["delay"],
            outer_optimizer=optax.sgd(outer[0], momentum=outer[1]) if outer else None,
            **extra,
        )
    got, state = run_library(averager, steps, p0)
    want = replay(steps, p0, **rule)
    for s, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5, err_msg=f"step {s}")
    assert np.asarray(state.inflight_start).shape == (R, 6)


def test_params_do_not_change_when_a_delayed_average_starts():
    averager = lsgd_jax.PeriodicModelAverager(4, delay=2)
    p0 = np.zeros(6, np.float32)
    got, _ = run_library(averager, 3, p0)
    dx = noise(3, (6,))
    np.testing.assert_allclose(got[0], dx[0], rtol=1e-6)  # step 0 starts: unchanged
    np.testing.assert_allclose(got[1], dx[0] + dx[1], rtol=1e-6)
    landed = dx[:3].sum(0) + (dx[0].mean(0) - dx[0])  # step 2: params + (mean - s)
    np.testing.assert_allclose(got[2], landed, rtol=1e-5, atol=1e-6)


def test_phases_with_a_delay():
    avg = lsgd_jax.PeriodicModelAverager(4, warmup_steps=1, delay=2)
    state = avg.init(jnp.zeros(2))
    assert state.num_phases == 4  # (no average, average) x (landing or not)
    tx = optax.chain(lsgd_jax.post_local_sgd(1), optax.sgd(0.1), lsgd_jax.model_averaging(avg))
    # hook: global at step 0; averager: starts at 1, 5; lands at 3, 7
    assert lsgd_jax.replay_phases(tx.init(jnp.zeros(2)), 8).tolist() == [4, 1, 0, 2, 0, 1, 0, 2]


def test_a_checkpoint_in_flight_resumes_bitwise(tmp_path):
    mesh = mesh_2x4()

    def make():
        return optax.chain(
            lsgd_jax.post_local_sgd(2, post_local_gradient_allreduce=False),
            optax.sgd(0.1, momentum=0.9),
            lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(4, 2, delay=3)),
        )

    loss = lambda p, b: jnp.mean((b["x"] @ p - b["y"]) ** 2)  # noqa: E731
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.standard_normal((16, 3), np.float32), "y": rng.standard_normal(16, np.float32)}
        for _ in range(12)
    ]
    p0 = jnp.zeros(3)

    def fresh(tx):
        return {"p": lsgd_jax.replicate(p0, mesh), "s": lsgd_jax.replicate(tx.init(p0), mesh)}

    def train(state, step, lo, hi, save_at=None):
        p, s = state["p"], state["s"]
        for k in range(lo, hi):
            p, s, _ = step(p, s, batches[k])
            if k + 1 == save_at:
                lsgd_jax.save_checkpoint(tmp_path, k + 1, {"p": p, "s": s})
        return np.asarray(p)

    tx = make()
    want = train(fresh(tx), lsgd_jax.data_parallel_step(loss, tx, mesh), 0, 12, save_at=4)
    tx = make()  # a new process: average started at step 2, lands at step 5
    state = lsgd_jax.restore_checkpoint(tmp_path, fresh(tx))
    got = train(state, lsgd_jax.data_parallel_step(loss, tx, mesh), 4, 12)
    np.testing.assert_array_equal(got, want)


def test_bad_delays_are_refused():
    with pytest.raises(ValueError, match="delay=4 must be below period"):
        lsgd_jax.PeriodicModelAverager(4, delay=4)
    with pytest.raises(ValueError, match=r"below period / fragments \(2\)"):
        lsgd_jax.PeriodicModelAverager(4, fragments=2, delay=2)
    with pytest.raises(ValueError, match="below the global period"):
        lsgd_jax.HierarchicalModelAverager({2: "local", 4: GLOBAL}, delay=4)
    with pytest.raises(ValueError, match="need an int period"):
        lsgd_jax.PeriodicModelAverager(lambda s: 4, delay=1)
    with pytest.raises(ValueError, match="average_opt_state is not supported"):
        lsgd_jax.post_local_sgd_optimizer(
            optax.sgd(0.1, momentum=0.9),
            lsgd_jax.PeriodicModelAverager(4, delay=1),
            average_opt_state=lambda s: jax.tree.map(lambda x: True, s),
        )
    with pytest.raises(ValueError, match="init"):
        lsgd_jax.PeriodicModelAverager(4, delay=1).init()


def delayed_run(
    options=None, steps=14, save_at=None, restore_from=None, tmp_path=None, lo=0, handoff=None
):
    mesh = mesh_2x4()
    tx = optax.chain(
        lsgd_jax.post_local_sgd(2, post_local_gradient_allreduce=False),
        optax.sgd(0.1, momentum=0.9),
        lsgd_jax.model_averaging(
            lsgd_jax.PeriodicModelAverager(
                4, 2, delay=2, outer_optimizer=optax.sgd(0.7, momentum=0.5)
            )
        ),
    )
    loss = lambda p, b: jnp.mean((b["x"] @ p - b["y"]) ** 2)  # noqa: E731
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.standard_normal((16, 3), np.float32), "y": rng.standard_normal(16, np.float32)}
        for _ in range(steps)
    ]
    step = lsgd_jax.data_parallel_step(loss, tx, mesh, **(options or {}))
    p0 = jnp.zeros(3)
    p, s = lsgd_jax.replicate(p0, mesh), lsgd_jax.replicate(tx.init(p0), mesh)
    if restore_from is not None:
        state = lsgd_jax.restore_checkpoint(tmp_path, {"p": p, "s": s}, step=restore_from)
        p, s = state["p"], state["s"]
    out = []
    for k in range(lo, steps):
        if handoff is not None and k == handoff[0]:  # the live state, to another step
            step = lsgd_jax.data_parallel_step(loss, tx, mesh, **handoff[1])
        p, s, _ = step(p, s, batches[k])
        out.append(np.asarray(p))
        if save_at is not None and k + 1 == save_at:
            lsgd_jax.save_checkpoint(tmp_path, k + 1, {"p": p, "s": s})
    return out, step


# Every way of running a step, by its options (the default first).
STEP_PATHS = [
    {},
    {"specialize": "switch"},
    {"specialize": False},
    {"lowering": "jit"},
    {"specialize": "switch", "lowering": "jit"},
]


def test_every_step_path_gives_the_same_numbers():
    want, _ = delayed_run()
    for options in STEP_PATHS[1:]:
        got, _ = delayed_run(options)
        for s, (a, b) in enumerate(zip(want, got)):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=f"{options} step {s}")


@pytest.mark.parametrize("save_at", [3, 5])  # an average started at step 2 lands at 4
@pytest.mark.parametrize("resume", STEP_PATHS, ids=str)
def test_a_checkpoint_with_an_average_in_flight_resumes_on_any_path(save_at, resume, tmp_path):
    """Issue 17, defect 1: a state saved while a delayed average is in flight holds the
    whole average (the step returns complete state), so any step path resumes it."""
    want, _ = delayed_run(save_at=save_at, tmp_path=tmp_path)
    got, _ = delayed_run(resume, restore_from=save_at, tmp_path=tmp_path, lo=save_at)
    for k, (a, b) in enumerate(zip(got, want[save_at:])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"step {save_at + k}")
        if resume == {}:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("at", [3, 5])
@pytest.mark.parametrize("to", STEP_PATHS[1:], ids=str)
def test_the_live_state_handed_to_another_step_continues_exactly(at, to):
    want, _ = delayed_run()
    got, _ = delayed_run(handoff=(at, to))
    for k, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"step {k}")
