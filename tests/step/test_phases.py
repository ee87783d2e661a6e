"""Phases in the open: data_parallel_step specializes its update per phase by pinning the
phase in each state's static metadata, which caches (jit, remat, scan) see."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import drain_callback_errors, mesh_2x4, tiny_mlp

import lsgd_jax

# the slow tier: 31 s on 2 workers (2026-12-01)
pytestmark = pytest.mark.slow

GLOBAL = ("node", "local")


init_params, loss_fn = tiny_mlp()  # 6 -> 8 -> 1


def batches(steps, n=64):
    rng = np.random.default_rng(1)
    return [
        {"x": rng.standard_normal((n, 6), np.float32), "y": rng.standard_normal((n, 1), np.float32)}
        for _ in range(steps)
    ]


def make_tx(levels=None):
    averager = (
        lsgd_jax.HierarchicalModelAverager(levels, warmup_steps=3)
        if levels
        else lsgd_jax.PeriodicModelAverager(3, warmup_steps=3)
    )
    return optax.chain(
        lsgd_jax.post_local_sgd(3, post_local_gradient_allreduce=False),
        optax.sgd(0.1, momentum=0.9),
        lsgd_jax.model_averaging(averager),
    )


def run(tx, steps=10, **kwargs):
    mesh = mesh_2x4()
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, **kwargs)
    p, s = lsgd_jax.replicate(init_params(), mesh), lsgd_jax.replicate(tx.init(init_params()), mesh)
    losses = []
    for b in batches(steps):
        p, s, loss = step(p, s, b)
        losses.append(float(loss))
    return np.asarray(p["w1"]), losses


def wrapped(tx, how):
    """``tx`` with its update wrapped as some codebases do."""
    if how == "jit":
        update = jax.jit(tx.update)
    elif how == "remat":
        update = jax.checkpoint(tx.update)
    else:  # scan: the update as the body of a length-1 scan over its state

        def update(updates, state, params=None):
            def body(carry, _):
                u, s = tx.update(updates, carry, params)
                return s, u

            state, u = jax.lax.scan(body, state, length=1)
            return jax.tree.map(lambda x: x[0], u), state

    return optax.GradientTransformationExtraArgs(tx.init, update)


@pytest.fixture(scope="module")
def reference():
    return run(make_tx(), specialize=False)


@pytest.mark.parametrize("how", ["jit", "remat", "scan"])
def test_wrapped_updates_give_the_same_numbers_specialized_or_not(how, reference):
    # A contextvar pin used to be baked into a trace that jit/remat cached, giving wrong
    # params (max |diff| 0.07 after 10 steps), also for later specialize=False steps.
    want_p, want_losses = reference
    tx = wrapped(make_tx(), how)
    got_p, got_losses = run(tx, specialize=True)
    np.testing.assert_allclose(got_p, want_p, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
    got_p, got_losses = run(tx, specialize=False)  # the same wrapped update, after
    np.testing.assert_allclose(got_p, want_p, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("specialize", [True, "switch"])
def test_every_way_of_compiling_the_phases_gives_the_same_numbers(specialize, reference):
    want_p, want_losses = reference
    got_p, got_losses = run(make_tx(), specialize=specialize)
    np.testing.assert_allclose(got_p, want_p, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)


def test_the_switch_falls_back_to_the_conds_past_max_phases(reference, monkeypatch):
    from lsgd_jax.step import _step_program

    monkeypatch.setattr(_step_program, "MAX_PHASES", 3)  # 2 x 2 phases: past it
    got_p, _ = run(make_tx(), specialize="switch")
    np.testing.assert_allclose(got_p, reference[0], rtol=1e-6, atol=1e-6)


def test_one_program_per_phase_compiled_when_the_phase_first_occurs():
    mesh = mesh_2x4()
    tx = make_tx()  # hook 2 phases x averager 2: global grads until 3, averages 3, 6, 9
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, compile_ahead=0)
    p, s = lsgd_jax.replicate(init_params(), mesh), lsgd_jax.replicate(tx.init(init_params()), mesh)
    seen = []
    for b in batches(5):
        p, s, _ = step(p, s, b)
        seen.append(sorted(step._programs.made()))
    # phase 2: global grads, no average; 1: local grads + average; 0: local, none
    assert seen == [[2], [2], [2], [1, 2], [0, 1, 2]]
    assert lsgd_jax.replay_phases(tx.init({}), 5).tolist() == [2, 2, 2, 1, 0]


def run_from_the_start(tx, num_steps):
    """A step that keeps its inputs, run ``num_steps`` calls from the first state, each
    fed the state the last returned; ``(step, first params, first state)``."""
    mesh = mesh_2x4()
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, donate=False)
    p0 = lsgd_jax.replicate(init_params(), mesh)
    s0 = lsgd_jax.replicate(tx.init(init_params()), mesh)
    p, s = p0, s0
    for b in batches(num_steps):
        p, s, _ = step(p, s, b)
    return step, p0, s0


def test_a_state_the_step_did_not_return_is_read_again():
    mesh, tx = mesh_2x4(), make_tx()
    step, p0, s0 = run_from_the_start(tx, 4)
    again, _, _ = step(p0, s0, batches(1)[0])  # back to step 0: phase 2 again, not 0
    first, _, _ = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, donate=False)(
        p0, s0, batches(1)[0]
    )
    np.testing.assert_array_equal(np.asarray(again["w1"]), np.asarray(first["w1"]))


def test_a_plan_that_goes_on_keys_the_state_structure_once(monkeypatch):
    """Each call fed the state the last one returned continues the phase plan without
    flattening the state again (a tree_structure a call: 0.1 ms of host time on a CPU
    mesh); a state the step did not return is keyed and read again."""
    from lsgd_jax.step._phase_plan import PhasePlan

    keyed = []
    fixed_mode = PhasePlan.fixed_mode
    monkeypatch.setattr(
        PhasePlan, "fixed_mode", lambda self, state: keyed.append(1) or fixed_mode(self, state)
    )
    # the warm-up, the switch, local steps and averages
    step, p0, s0 = run_from_the_start(make_tx(), 8)
    assert len(keyed) == 1
    step(p0, s0, batches(1)[0])
    assert len(keyed) == 2


def skipping(tx):
    """A wrapper the step does not know, which skips every other update."""

    def init(params):
        return {"inner": tx.init(params), "n": jnp.zeros([], jnp.int32)}

    def update(g, state, params=None):
        u, inner = tx.update(g, state["inner"], params)
        keep = state["n"] % 2 == 0
        inner = jax.tree.map(lambda a, b: jnp.where(keep, a, b), inner, state["inner"])
        u = jax.tree.map(lambda x: jnp.where(keep, x, 0), u)
        return u, {"inner": inner, "n": state["n"] + 1}

    return optax.GradientTransformation(init, update)


def test_a_wrong_phase_changes_nothing_and_raises():
    with pytest.raises(RuntimeError, match="specialize='switch'"):
        run(skipping(make_tx()), steps=40, specialize=True)
    want, _ = run(skipping(make_tx()), specialize=False)
    got, _ = run(skipping(make_tx()), specialize="switch")
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_known_skipping_wrappers_branch_on_the_device(reference):
    tx = optax.MultiSteps(make_tx(), every_k_schedule=2)
    want, _ = run(tx, specialize=False)
    got, _ = run(tx, specialize=True)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_phase_index_is_the_mixed_radix_number_of_the_states_phases():
    tx = make_tx({1: "local", 2: GLOBAL})
    state = tx.init({})
    hook, averager = state[0], state[2]
    assert (hook.num_phases, averager.num_phases) == (2, 3)
    assert lsgd_jax.num_phases(state) == 6
    assert int(lsgd_jax.phase_index(state)) == 1 * 3 + 0  # global grads, no average (warm-up)
    later = (hook.replace(iter=jnp.int32(3)), state[1], averager.replace(step=jnp.int32(4)))
    assert int(lsgd_jax.phase_index(later)) == 0 * 3 + 2  # node-local grads, global level
    assert int(lsgd_jax.phase_index(later[:2])) == 0
    assert lsgd_jax.num_phases(optax.sgd(0.1).init({})) == 1


def test_a_three_state_product_is_specialized_or_falls_back_with_the_same_numbers():
    # Two averagers (one per params subtree is not supported; here two chains in turn).
    levels = {1: "local", 2: GLOBAL}
    want_p, _ = run(make_tx(levels), specialize=False)
    got_p, _ = run(make_tx(levels), specialize=True)
    np.testing.assert_allclose(got_p, want_p, rtol=1e-6, atol=1e-6)


def test_compile_ahead_leaves_no_compilation_to_the_steps():
    """Issue 18: step.compile(..., num_steps=N) compiles every phase of the next N calls,
    so none of them stalls to compile."""
    import threading

    mesh = mesh_2x4()
    tx = make_tx()
    data = batches(5)

    def fresh():
        return (lsgd_jax.replicate(init_params(), mesh),
                lsgd_jax.replicate(tx.init(init_params()), mesh))  # fmt: skip

    # a first run, by another step: whatever small host-side programs a call runs (a
    # replicate, a counter read) are compiled once per process, not per step
    other, (p, s) = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, compile_ahead=0), fresh()
    for b in data:
        p, s, _ = other(p, s, b)
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, compile_ahead=0)
    p, s = fresh()
    compiled = step.compile(p, s, data[0], num_steps=5)
    assert sorted(compiled) == [0, 1, 2] and all(t > 0 for t in compiled.values())
    assert step.compile(p, s, data[0], num_steps=5) == {}  # nothing left to compile
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: (
            compiles.append(threading.current_thread().name) if "backend_compile" in name else None
        )
    )
    try:
        for b in data:
            p, s, _ = step(p, s, b)
        jax.block_until_ready(p)
    finally:
        jax.monitoring.clear_event_listeners()
    # the listener is process-wide: an earlier test's step may still compile on its own
    # background thread; this step compiled nothing on the caller's
    assert threading.current_thread().name not in compiles


@pytest.mark.parametrize("ahead", [4, 0])
def test_coming_phases_compile_in_the_background(ahead):
    """Issue 17: with compile_ahead (default 4) the programs of phases still to come are
    compiled on a background thread while the steps run; only the first phase compiles
    on the caller's thread. With 0, each phase compiles on the caller's thread."""
    import threading

    mesh = mesh_2x4()
    tx = make_tx()  # phases 2, 2, 2, 1, 0: global grads until 3, then local + averages
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, compile_ahead=ahead)
    p, s = lsgd_jax.replicate(init_params(), mesh), lsgd_jax.replicate(tx.init(init_params()), mesh)
    where = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: (
            where.append(threading.current_thread().name) if "backend_compile" in name else None
        )
    )
    try:
        out = []
        for b in batches(5):
            p, s, loss = step(p, s, b)
            out.append(float(loss))
    finally:
        jax.monitoring.clear_event_listeners()
    # the listener is process-wide: a step of an earlier test on this worker may still be
    # compiling on its own background thread, so count the caller's compiles and ask this
    # step whether it started a background compile at all
    mine = where.count(threading.current_thread().name)
    background = [w for w in where if w.startswith("lsgd_jax-compile")]
    if ahead:
        assert len(background) >= 2 and mine == 1
    else:
        assert step._programs._executor is None and mine == 3
    # the same numbers either way
    step0 = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, compile_ahead=0)
    p, s = lsgd_jax.replicate(init_params(), mesh), lsgd_jax.replicate(tx.init(init_params()), mesh)
    want = []
    for b in batches(5):
        p, s, loss = step0(p, s, b)
        want.append(float(loss))
    assert out == want


def test_compile_ahead_is_checked():
    with pytest.raises(ValueError, match="compile_ahead"):
        lsgd_jax.data_parallel_step(loss_fn, make_tx(), mesh_2x4(), compile_ahead=-1)


def test_the_step_stops_at_the_int32_maximum_of_a_callable_period_as_the_device_does():
    """Issue 26, item 7: the host's plan replayed past the counter's end and raised
    numpy's "OverflowError: Python integer 2147483648 out of bounds for int32" calls
    before it (after a call that had run, losing its outputs); the device raised the
    library's message at the call at the maximum, wrapped in a JaxRuntimeError."""
    mesh = mesh_2x4()
    averager = lsgd_jax.PeriodicModelAverager(lambda s: jnp.where(s < 100, 2, 2**31 - 10))
    tx = optax.chain(lsgd_jax.post_local_sgd(0), optax.sgd(0.1), lsgd_jax.model_averaging(averager))
    first = 2**31 - 1 - 6  # six calls can run, the seventh's counter cannot advance
    hook, inner, avg = tx.init(init_params())
    near = (hook, inner, avg.replace(step=jnp.int32(first), last_sync=jnp.int32(first - 1)))
    data = batches(7)
    said = "PeriodicModelAverager (AdaptiveSchedule(period=<lambda>)): the averager's step "
    said += "counter reached the int32 maximum at step 2147483647"
    fresh = lambda: (lsgd_jax.replicate(init_params(), mesh), lsgd_jax.replicate(near, mesh))  # noqa: E731

    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh)  # one program per phase
    p, s = fresh()
    assert step.plan_of(p, s, data[0], num_steps=6) == [0] * 6
    ahead = r"^replaying 7 calls from step 2147483641: call 7, at step 2147483647, cannot run"
    with pytest.raises(OverflowError, match=ahead):
        step.compile(p, s, data[0], num_steps=7)
    with pytest.raises(OverflowError, match=ahead):
        lsgd_jax.communication_ledger(step, p, s, data[0], num_steps=7)
    for b in data[:6]:
        p, s, _ = step(p, s, b)
    with pytest.raises(OverflowError, match=r"call 7, at step 2147483647, cannot run") as info:
        step(p, s, data[6])
    assert said in str(info.value) and "last_sync=state.last_sync - k" in str(info.value)
    assert not s[2].step.is_deleted()  # refused before it ran: the state is there to save
    assert np.asarray(s[2].step).tolist() == [2**31 - 1] * 8

    switch = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, specialize="switch")
    p, s = fresh()
    for b in data[:6]:
        p, s, _ = switch(p, s, b)
    with pytest.raises(Exception, match="reached the int32 maximum") as info:  # noqa: B017
        jax.block_until_ready(switch(p, s, data[6]))
    assert said in str(info.value)  # the device's words are the host's
    drain_callback_errors()  # every device's check raised: not in another test's step
