"""comm.quantized(): int8 / 4-bit means with per-block scales and error feedback."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import DATA, mesh_2x4, put, smap, squeeze, unsqueeze
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mp_worker import CFG, global_batch, init_params, loss_fn, train

import lsgd_jax
from lsgd_jax import comm

# the slow tier: 42 s on 2 workers (2026-12-01)
pytestmark = pytest.mark.slow

QMAX = {8: 127, 4: 7}
BLOCK = 64
N, K, NODES = 8, 4, 2  # replicas, devices per node, nodes


def average_fn(averager):
    """jit(shard_map(average_parameters)) over the 2 x 4 mesh, per-replica values."""

    def body(params, state):
        p, s = averager.average_parameters(squeeze(params), squeeze(state))
        return unsqueeze(p), unsqueeze(s)

    return smap(body, mesh_2x4(), (DATA, DATA), (DATA, DATA))


def init_state(averager, params0):
    return lsgd_jax.replicate(averager.init(params0), mesh_2x4())


def flat_values(tree):
    """(replicas, values): the leaves in tree order, as pack() lays them out."""
    return np.concatenate(
        [np.asarray(x, np.float64).reshape(N, -1) for x in jax.tree.leaves(tree)], 1
    )


def block_absmax(v):
    """max |v| over each block of BLOCK values along the last axis (zero-padded)."""
    v = np.abs(v)
    v = np.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, (-v.shape[-1]) % BLOCK)])
    return v.reshape(*v.shape[:-1], -1, BLOCK).max(-1)


def per_value(blocks, length):
    return np.repeat(blocks, BLOCK, axis=-1)[..., :length]


def error_bound(x, bits, two_level):
    """What one quantized mean of ``x`` (replicas, values) may be off by, per value.

    Blocks line up with the flat buffer (chunks and shards are whole blocks). One level:
    stage 1 puts each replica's block within s_i / 2 (s = absmax / qmax), so the chunk
    mean is within mean_i(s_i) / 2; stage 2 adds s / 2 of the chunk mean's block, whose
    absmax is at most the exact mean's plus that. Two levels: the same, on the node sums
    of the shards, divided by the devices per node.
    """
    qmax = QMAX[bits]
    mean = x.mean(0)
    if two_level:
        sums = x.reshape(NODES, K, -1).sum(1)
        b1 = block_absmax(sums).mean(0) / qmax / 2  # on the chunk mean of the node sums
        b2 = (block_absmax(K * mean) + b1) / qmax / 2
        bound = (b1 + b2) / K
    else:
        b1 = block_absmax(x).mean(0) / qmax / 2
        b2 = (block_absmax(mean) + b1) / qmax / 2
        bound = b1 + b2
    slack = 1e-6 * block_absmax(x).max(0)  # float32 sums and products
    return per_value(bound + slack, x.shape[1])


def spread_values(seed, shapes):
    """Per-replica values whose blocks of 64 differ in magnitude by up to 1e6."""
    rng = np.random.default_rng(seed)
    total = sum(int(np.prod(s)) for s in shapes.values())
    scale = per_value(10.0 ** rng.uniform(-3, 3, -(-total // BLOCK)), total)
    flat = (rng.normal(size=(N, total)) * scale).astype(np.float32)
    out, offset = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape))
        out[name] = jnp.asarray(flat[:, offset : offset + size].reshape((N, *shape)))
        offset += size
    return out


CASES = [(8, False), (4, False), (8, True), (4, True)]


@pytest.mark.parametrize("bits, two_level", CASES)
def test_one_average_is_within_the_block_scale_bound_and_identical_everywhere(bits, two_level):
    values = spread_values(bits + two_level, {"a": (1000,), "b": (37, 40)})  # 2480: padded
    strategy = comm.quantized(bits, two_level=two_level)
    avg = lsgd_jax.PeriodicModelAverager(2, communication=strategy)
    out, state = average_fn(avg)(put(values, mesh_2x4(), DATA), init_state(avg, squeeze(values)))
    got, x = flat_values(out), flat_values(values)
    assert (got == got[0]).all()  # bitwise, every replica
    err = np.abs(got[0] - x.mean(0))
    bound = error_bound(x, bits, two_level)
    assert (err <= bound).all(), np.max(err / bound)
    assert np.max(err / bound) > 0.1  # really quantized, and the bound is not vacuous
    residual = flat_values(state.comm_state)
    assert (residual != 0).any()


def test_a_mean_without_error_feedback_needs_no_state_and_matches_it():
    values = spread_values(0, {"w": (512,)})
    with_ef = lsgd_jax.PeriodicModelAverager(2, communication=comm.quantized(8))
    without = lsgd_jax.PeriodicModelAverager(
        2, communication=comm.quantized(8, error_feedback=False)
    )
    assert without.init().comm_state is None
    a, _ = average_fn(with_ef)(put(values, mesh_2x4(), DATA), init_state(with_ef, squeeze(values)))
    b, _ = average_fn(without)(put(values, mesh_2x4(), DATA), init_state(without, None))
    np.testing.assert_array_equal(a["w"], b["w"])  # a zero residual changes nothing


def averaging_report(strategy, size=1 << 20):
    """The model-averaging collectives of one compiled average of ``size`` float32."""
    mesh = mesh_2x4()
    avg = lsgd_jax.PeriodicModelAverager(2, communication=strategy)
    sharding = NamedSharding(mesh, DATA)

    def abstract(x):
        return jax.ShapeDtypeStruct((N, *jnp.shape(x)), jnp.result_type(x), sharding=sharding)

    params = jnp.zeros(size, jnp.float32)
    args = jax.tree.map(abstract, (params, avg.init(params)))
    report = lsgd_jax.communication_report(average_fn(avg), *args, mesh=mesh)
    return [c for c in report if c.scope == "model_averaging"]


def wire(collectives):
    return sum(c.wire_bytes for c in collectives)


def test_wire_bytes_of_int8_and_4bit_against_a_float32_all_reduce():
    size = 1 << 20
    flat = averaging_report(comm.flat(), size)
    assert [c.kind for c in flat] == ["all-reduce"]
    ratios = {}
    for bits in (8, 4):
        one = averaging_report(comm.quantized(bits), size)
        assert sorted(c.kind for c in one) == ["all-gather", "all-to-all"]
        per_value = bits / 8 + 4 / BLOCK  # the integer and its share of a float32 scale
        by_kind = {c.kind: c.bytes for c in one}
        assert by_kind == {"all-to-all": size * per_value, "all-gather": size / N * per_value}
        ratios[bits] = wire(one) / wire(flat)

        two = averaging_report(comm.quantized(bits, two_level=True), size)
        across = [c for c in two if c.axes == ("node",)]
        inside = [c for c in two if c.axes == ("local",)]
        assert len(across) + len(inside) == len(two)
        # Across nodes: only the shard (1/4 of the values), as integers and scales.
        shard = size / K
        assert {c.kind: c.bytes for c in across} == {
            "all-to-all": shard * per_value,
            "all-gather": shard / NODES * per_value,
        }
        assert {c.kind: c.bytes for c in inside} == {
            "reduce-scatter": 4 * size,
            "all-gather": 4 * shard,
        }
        # One level: 4 of each device's 7 peers are on the other node.
        one_across = wire(one) * 4 / 7
        ratios[bits, "two-level across / one-level across"] = wire(across) / one_across
        assert 0.2 < wire(across) / one_across < 0.3
    assert ratios[8] <= 0.3
    assert ratios[4] <= 0.17


def drift(bits, two_level, error_feedback, rounds=200, size=1024):
    """Averages after every step of small local updates with a common direction.

    Returns the quantized trajectory's end, the mean residual there, and the exact end.
    """
    rng = np.random.default_rng(1)
    p0 = rng.normal(size=size).astype(np.float32)
    direction = rng.normal(size=size)
    updates = (3e-3 * (direction + 2 * rng.normal(size=(rounds, N, size)))).astype(np.float32)
    exact = p0 + updates.astype(np.float64).mean(1).sum(0)

    mesh = mesh_2x4()
    strategy = comm.quantized(bits, two_level=two_level, error_feedback=error_feedback)
    with pytest.warns(UserWarning, match="period is 1"):
        avg = lsgd_jax.PeriodicModelAverager(1, communication=strategy)
    steps = P(None, ("node", "local"))

    def body(p, s, u):
        def one(carry, u_t):
            p, s = carry
            return avg.average_parameters(p + u_t[0], s), None

        p, s = lax.scan(one, (squeeze(p), squeeze(s)), u)[0]
        return unsqueeze(p), unsqueeze(s)

    f = smap(body, mesh, (DATA, DATA, steps), (DATA, DATA))
    state = init_state(avg, jnp.asarray(p0))
    p, state = f(lsgd_jax.replicate(p0, mesh), state, put(jnp.asarray(updates), mesh, steps))
    residual = None
    if error_feedback:
        residual = np.asarray(state.comm_state, np.float64).mean(0)
    return np.asarray(p, np.float64), residual, exact


@pytest.mark.parametrize("bits, two_level", [(8, False), (4, False), (4, True)])
def test_error_feedback_keeps_long_runs_on_the_exact_trajectory(bits, two_level):
    p, residual, exact = drift(bits, two_level, error_feedback=True)
    p_no, _, _ = drift(bits, two_level, error_feedback=False)
    assert (p == p[0]).all() and (p_no == p_no[0]).all()
    with_ef, without = np.linalg.norm(p[0] - exact), np.linalg.norm(p_no[0] - exact)
    assert with_ef < 0.5 * without, (with_ef, without)
    # The means telescope: end + mean residual == exact end, up to float32 rounding
    # over 200 rounds; so the distance stays within a grid step of the params' blocks.
    np.testing.assert_allclose(p[0] + residual, exact, atol=1e-4)
    grid = per_value(block_absmax(p[0]) / QMAX[bits], p.shape[1])
    assert (np.abs(p[0] - exact) <= 1.5 * grid).all()


def test_the_residual_is_params_shaped_state_and_resumes_bitwise(tmp_path):
    mesh = mesh_2x4()
    strategy = comm.quantized(4, two_level=True)

    def make_tx():
        avg = lsgd_jax.PeriodicModelAverager(2, warmup_steps=2, communication=strategy)
        return optax.chain(
            lsgd_jax.post_local_sgd(2),
            lsgd_jax.post_local_sgd_optimizer(optax.sgd(CFG["lr"], momentum=0.9), avg),
        )

    p0 = init_params()
    tx = make_tx()
    (averager_state,) = lsgd_jax.averager_states(tx.init(p0))
    residual = averager_state.comm_state
    assert jax.tree.structure(residual) == jax.tree.structure(p0)
    for r, p in zip(jax.tree.leaves(residual), jax.tree.leaves(p0)):
        assert r.shape == p.shape and r.dtype == jnp.float32 and not r.any()

    def fresh():
        return {
            "params": lsgd_jax.replicate(p0, mesh),
            "opt_state": lsgd_jax.replicate(make_tx().init(p0), mesh),
        }

    def on_step(s, state):
        if s + 1 == 4:
            lsgd_jax.save_checkpoint(tmp_path, 4, state)

    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh)
    want = train(fresh(), step, 0, 3, global_batch)  # averages at step 2
    (after,) = lsgd_jax.averager_states(want["opt_state"])
    assert any(np.asarray(r).any() for r in jax.tree.leaves(after.comm_state))
    assert all((p == p[0]).all() for p in jax.tree.leaves(want["params"]))
    want = train(want, step, 3, 7, global_batch, on_step)  # and at 4, 6

    restored = lsgd_jax.restore_checkpoint(tmp_path, fresh(), strict=True)
    (back,) = lsgd_jax.averager_states(restored["opt_state"])
    assert any(np.asarray(r).any() for r in jax.tree.leaves(back.comm_state))
    got = train(restored, lsgd_jax.data_parallel_step(loss_fn, make_tx(), mesh), 4, 7, global_batch)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(g, w)


def test_fragments_average_their_slice_within_the_bound():
    values = spread_values(5, {"a": (700,), "b": (1300,)})
    avg = lsgd_jax.PeriodicModelAverager(
        4, fragments=2, communication=comm.quantized(8, two_level=True)
    )
    f = average_fn(avg)
    x = flat_values(values)
    params, state = put(values, mesh_2x4(), DATA), init_state(avg, squeeze(values))
    half = x.shape[1] // 2
    for step, fragment in [(0, slice(0, half)), (1, None), (2, slice(half, None))]:
        params, state = f(params, state)
        got = flat_values(params)
        if fragment is None:
            continue
        assert (got[:, fragment] == got[0, fragment]).all()
        # A fragment is packed on its own: its blocks start at its first value.
        err = np.abs(got[0, fragment] - x[:, fragment].mean(0))
        assert (err <= error_bound(x[:, fragment], 8, two_level=True)).all()
        residual = flat_values(state.comm_state)
        assert (residual[:, fragment] != 0).any()
        if step == 0:
            np.testing.assert_array_equal(got[:, half:], x[:, half:])  # untouched
            assert not residual[:, half:].any()


def test_delta_averaging_quantizes_the_change_only():
    mesh = mesh_2x4()
    rng = np.random.default_rng(3)
    anchor = jnp.asarray(rng.normal(size=2048).astype(np.float32) * 100)
    change = (rng.normal(size=(N, 2048)) * 1e-2).astype(np.float32)
    values = anchor[None] + change
    avg = lsgd_jax.PeriodicModelAverager(2, delta=True, communication=comm.quantized(4))
    out, _ = average_fn(avg)(put(values, mesh, DATA), init_state(avg, anchor))
    got = np.asarray(out, np.float64)
    assert (got == got[0]).all()
    x = np.asarray(values, np.float64) - np.asarray(anchor, np.float64)
    err = np.abs(got[0] - np.asarray(anchor, np.float64) - x.mean(0))
    slack = 1e-7 * np.abs(np.asarray(anchor))  # float32 rounding of anchor + mean change
    assert (err <= error_bound(x, 4, two_level=False) + slack).all()
    assert err.max() < 0.05  # the params themselves (about 100) would round by about 10


def test_a_pmap_index_group_mean_takes_the_one_level_path():
    groups = lsgd_jax.node_groups("batch", devices_per_node=4)
    values = spread_values(9, {"w": (300,)})["w"]

    def f(x):
        return comm.apply(comm.quantized(8, error_feedback=False), x, groups).value

    got = np.asarray(jax.pmap(f, axis_name="batch")(values), np.float64)
    x = np.asarray(values, np.float64)
    for node in (slice(0, 4), slice(4, 8)):
        assert (got[node] == got[node][0]).all()
        sub = np.concatenate([x[node]] * 2)  # the bound of a 4-replica group, from 8 rows
        qmax = QMAX[8]
        b1 = block_absmax(x[node]).mean(0) / qmax / 2
        b2 = (block_absmax(x[node].mean(0)) + b1) / qmax / 2
        bound = per_value(b1 + b2 + 1e-6 * block_absmax(sub).max(0), x.shape[1])
        assert (np.abs(got[node][0] - x[node].mean(0)) <= bound).all()
    assert not np.allclose(got[0], got[4])


@pytest.mark.parametrize("two_level", [False, True])
def test_nan_spreads_over_its_block_and_zero_blocks_stay_zero(two_level):
    mesh = mesh_2x4()
    values = np.array(spread_values(2, {"w": (1024,)})["w"])
    values[3, 130] = np.nan  # block 2
    values[5, 600] = np.inf  # block 9
    values[:, 256:320] = 0.0  # block 4
    strategy = comm.quantized(8, two_level=two_level)

    def body(x, r):
        out = comm.apply(strategy, x[0], ("node", "local"), r[0])
        return out.value[None], out.state[None]

    f = smap(body, mesh, (DATA, DATA), (DATA, DATA))
    out, residual = f(put(jnp.asarray(values), mesh, DATA), put(jnp.zeros((N, 1024)), mesh, DATA))
    out = np.asarray(out).reshape(N, -1, BLOCK)
    bad = np.isnan(out[0]).all(1)
    assert bad[[2, 9]].all() and bad.sum() == 2  # the whole block, on every replica
    assert np.isnan(out[:, [2, 9]]).all()
    assert (out[:, 4] == 0).all()  # scale 1, not 0/0
    assert np.isfinite(np.asarray(residual)).all()


def test_bad_arguments_and_the_stateless_hook_are_explained():
    with pytest.raises(ValueError, match="bits must be 8 or 4, got 3"):
        comm.quantized(bits=3)
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        comm.quantized(block_size=0)
    with pytest.raises(ValueError, match="block_size must be even, got 63"):
        comm.quantized(bits=4, block_size=63)
    with pytest.raises(TypeError, match="error_feedback must be True or False"):
        comm.quantized(error_feedback="yes")
    with pytest.raises(TypeError, match="two_level must be True or False"):
        comm.quantized(two_level=1)
    with pytest.raises(ValueError, match=r"state.init\(params\)"):
        lsgd_jax.post_local_sgd(4, communication=comm.quantized()).init(None)
    with pytest.raises(ValueError, match=r"averager.init\(params\)"):
        lsgd_jax.PeriodicModelAverager(2, communication=comm.quantized()).init()

    # Without error feedback the hook takes it: the gradient mean, quantized.
    mesh = mesh_2x4()
    hook = lsgd_jax.post_local_sgd(1, communication=comm.quantized(error_feedback=False))
    grads = spread_values(4, {"g": (256,)})["g"]

    def body(g, s):
        out, s = hook.update(squeeze(g), squeeze(s))
        return unsqueeze(out), unsqueeze(s)

    f = smap(body, mesh, (DATA, DATA), (DATA, DATA))
    out, _ = f(put(grads, mesh, DATA), lsgd_jax.replicate(hook.init(None), mesh))
    out, x = np.asarray(out, np.float64), np.asarray(grads, np.float64)
    assert (out == out[0]).all()
    assert (np.abs(out[0] - x.mean(0)) <= error_bound(x, 8, two_level=False)).all()


def test_two_level_keeps_a_node_level_exact_and_its_residual():
    # A hierarchy's node level never crosses nodes: with two_level=True it is a plain
    # float32 mean, and the error-feedback residual is only the global level's.
    import jax
    import jax.numpy as jnp
    import numpy as np
    from helpers import DATA, mesh_2x4, put, smap, squeeze, unsqueeze

    import lsgd_jax

    mesh = mesh_2x4()
    strategy = lsgd_jax.comm.quantized(4, two_level=True)
    averager = lsgd_jax.HierarchicalModelAverager(
        {1: "local", 4: ("node", "local")}, communication=strategy
    )

    def body(params, state):
        p, s = averager.average_parameters(squeeze(params), squeeze(state))
        return unsqueeze(p), unsqueeze(s)

    f = smap(body, mesh, (DATA, DATA), (DATA, DATA))
    p0 = jnp.zeros(64)
    values = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    state = lsgd_jax.replicate(averager.init(p0), mesh)
    state = jax.tree.map(lambda x: x, state)
    state = state.replace(step=state.step + 1)  # step 1: the node level
    out, state = f(put(jnp.asarray(values), mesh, DATA), state)
    want = values.reshape(2, 4, 64).mean(1, keepdims=True).repeat(4, 1).reshape(8, 64)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(state.comm_state), 0.0)
