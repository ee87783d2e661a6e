"""Where the beyond-PyTorch options meet: each case a probe against the documented rules
found wrong (the numbers are the probe's). The property test in test_spec.py covers the
combinations at large; these pin the cases down one by one."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import DATA, mesh_2x4, put, smap, squeeze, unsqueeze

import lsgd_jax

RANKS = np.arange(8, dtype=np.float32)


def run(averager, values, init_params, steps=1, nan_at=None):
    """Calls ``average_parameters`` ``steps`` times with per-replica state (as
    data_parallel_step keeps it); ``values``: [8, ...] per-replica params, used as given
    on the first call and carried after. ``nan_at``: {step: replica} to poison first."""
    mesh = mesh_2x4()

    def body(params, state):
        p, s = averager.average_parameters(squeeze(params), squeeze(state))
        return unsqueeze(p), unsqueeze(s)

    f = smap(body, mesh, (DATA, DATA), (DATA, DATA))
    state = lsgd_jax.replicate(averager.init(init_params), mesh)
    params = jax.tree.map(lambda v: put(jnp.asarray(v), mesh, DATA), values)
    history = []
    for s in range(steps):
        if nan_at and s in nan_at:
            params = jax.tree.map(lambda x, r=nan_at[s]: x.at[r].set(jnp.nan), params)
        params, state = f(params, state)
        history.append(jax.tree.map(np.asarray, params))
    return history, state


def test_delta_with_fragments_keeps_averaging_every_fragment():
    # The anchor used to take the replica's own params outside the averaged fragment, so
    # later averages of the other fragments moved replicas together but never equalized.
    averager = lsgd_jax.PeriodicModelAverager(2, fragments=2, delta=True)
    values = np.stack([RANKS, RANKS], axis=1)  # replica r holds [r, r]
    history, state = run(averager, values, jnp.zeros(2), steps=3)
    np.testing.assert_array_equal(history[0][:, 0], 3.5)  # step 0: fragment 1
    np.testing.assert_array_equal(history[0][:, 1], RANKS)
    np.testing.assert_array_equal(history[2], 3.5)  # step 2: fragment 2, not 0,0,1,1,...
    np.testing.assert_array_equal(np.asarray(state.anchor), 3.5)


def test_a_skipped_global_average_with_delta_keeps_the_anchor():
    # Hierarchical {1: local, 4: global}, NaN in replica 5 at the global average (step 0):
    # its skip used to set each replica's anchor to its own params, so node 0's later
    # local average gave [0, 1, 2, 3].
    averager = lsgd_jax.HierarchicalModelAverager(
        {1: "local", 4: ("node", "local")}, delta=True, nonfinite="skip"
    )
    values = np.repeat(RANKS[:, None], 3, axis=1)
    history, state = run(averager, values, jnp.zeros(3), steps=2, nan_at={0: 5})
    np.testing.assert_array_equal(history[0][[0, 1, 2, 3, 4, 6, 7]], values[[0, 1, 2, 3, 4, 6, 7]])
    np.testing.assert_array_equal(np.asarray(state.anchor), 0.0)  # never moved
    np.testing.assert_array_equal(history[1][:4], 1.5)  # node 0: healthy, equalized
    np.testing.assert_array_equal(history[1][[4, 6, 7]], values[[4, 6, 7]])  # node 1 skips


def test_a_skipped_average_takes_no_outer_step():
    averager = lsgd_jax.PeriodicModelAverager(
        2, outer_optimizer=optax.sgd(0.5), outer_skip_first=False, nonfinite="skip"
    )
    values = np.repeat(RANKS[:, None], 3, axis=1)
    history, state = run(averager, values, jnp.zeros(3), nan_at={0: 5})
    keep = [0, 1, 2, 3, 4, 6, 7]
    np.testing.assert_array_equal(history[0][keep], values[keep])  # not 0, 0.5, ..., 3.5
    np.testing.assert_array_equal(np.asarray(state.outer_count), 0)
    np.testing.assert_array_equal(np.asarray(state.anchor), 0.0)


def test_a_skipped_first_average_does_not_use_up_outer_skip_first():
    averager = lsgd_jax.PeriodicModelAverager(
        2, outer_optimizer=optax.sgd(0.5, momentum=0.9), nonfinite="skip"
    )
    values = np.repeat(RANKS[:, None], 3, axis=1)
    history, state = run(averager, values, jnp.zeros(3), steps=3, nan_at={0: 5})
    # Step 0 skipped (NaN); replica 5 is healed by hand before step 2, whose average is
    # then the FIRST real one: a plain mean that sets the anchor, no outer step.
    assert int(np.asarray(state.outer_count)[0]) == 0
    healed = history[1].copy()
    healed[5] = 5.0
    history, state = run(averager, healed, jnp.zeros(3), steps=1)
    np.testing.assert_array_equal(history[0], 3.5)
    np.testing.assert_array_equal(np.asarray(state.outer_count), 1)


def test_the_outer_optimizer_leaves_integer_leaves_alone():
    averager = lsgd_jax.PeriodicModelAverager(
        2, outer_optimizer=optax.sgd(0.7), outer_skip_first=False
    )
    values = {"w": RANKS, "n": 10 * np.arange(8, dtype=np.int32)}
    history, _ = run(averager, values, {"w": jnp.float32(0), "n": jnp.int32(0)})
    np.testing.assert_array_equal(history[0]["n"], values["n"])  # not 0, 7, ..., 49
    np.testing.assert_allclose(history[0]["w"], 0.7 * 3.5, rtol=1e-6)


def test_fragments_average_the_moments_with_their_params():
    # Adam's mu and nu are params-shaped: element i of each is averaged on the step its
    # param element i is. They used to be cut by the optimizer state's own flattened
    # order (mu's values, then nu's), so nu was averaged on other steps, or not at all.
    mesh = mesh_2x4()
    averager = lsgd_jax.PeriodicModelAverager(2, fragments=2)
    tx = lsgd_jax.post_local_sgd_optimizer(
        optax.adam(0.1),
        averager,
        average_opt_state=lambda s: jax.tree.map(lambda x: jnp.ndim(x) > 0, s),
    )
    p0 = {"a": jnp.zeros(3), "b": jnp.zeros(1)}  # 4 values: fragment 1 = a[0:2]

    def body(params, opt_state, grads):
        params, opt_state = squeeze(params), squeeze(opt_state)
        updates, opt_state = tx.update(squeeze(grads), opt_state, params)
        return unsqueeze(optax.apply_updates(params, updates)), unsqueeze(opt_state)

    f = smap(body, mesh, (DATA, DATA, DATA), (DATA, DATA))
    grads = jax.tree.map(lambda x: jnp.arange(8.0).reshape(8, 1) * (1 + jnp.arange(x.size)), p0)
    params, opt_state = f(
        lsgd_jax.replicate(p0, mesh), lsgd_jax.replicate(tx.init(p0), mesh), put(grads, mesh, DATA)
    )

    def equal_over_replicas(x):
        x = np.asarray(x)
        return np.all(x == x[:1], axis=0)

    adam = opt_state.inner_state[0]
    for tree in (params, adam.mu, adam.nu):
        np.testing.assert_array_equal(equal_over_replicas(tree["a"]), [True, True, False])
        np.testing.assert_array_equal(equal_over_replicas(tree["b"]), [False])


def test_bf16_communication_keeps_the_imaginary_part():
    averager = lsgd_jax.PeriodicModelAverager(2, communication_dtype=jnp.bfloat16)
    values = (RANKS + 2j * RANKS).astype(np.complex64)[:, None] * np.ones((1, 3), np.complex64)
    history, _ = run(averager, values, None)
    np.testing.assert_array_equal(history[0], np.complex64(3.5 + 7j))
