"""Communication strategies at their edges: trees with empty leaves, the device order, an
inner axis outside the mesh or the group, padding (a quantized mean never sends more than
its float32 mean), and argument checks however a strategy is built.

The sections are numbered as issue 17's communication defects, which these tests pinned down.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import DATA, mesh_2x4, put, smap, squeeze, unsqueeze
from jax.sharding import Mesh, NamedSharding

import lsgd_jax
from lsgd_jax import comm
from lsgd_jax.step._ledger import crosses_nodes

# the slow tier: 44 s on 2 workers (2026-12-01)
pytestmark = pytest.mark.slow

N = 8
GLOBAL = ("node", "local")


def averaged(strategy, values, period=2):
    """One average of per-replica ``values`` (leading axis: replicas) over the 2 x 4 mesh."""
    mesh = mesh_2x4()
    averager = lsgd_jax.PeriodicModelAverager(period, communication=strategy)

    def body(params, state):
        p, s = averager.average_parameters(squeeze(params), squeeze(state))
        return unsqueeze(p), unsqueeze(s)

    f = smap(body, mesh, (DATA, DATA), (DATA, DATA))
    state = lsgd_jax.replicate(averager.init(squeeze(values)), mesh)
    return f(put(values, mesh, DATA), state)[0]


def hooked(strategy, grads):
    """The hook's global-phase mean of per-replica ``grads`` over the 2 x 4 mesh."""
    mesh = mesh_2x4()
    hook = lsgd_jax.post_local_sgd(1, communication=strategy)

    def body(g, s):
        out, s = hook.update(squeeze(g), squeeze(s))
        return unsqueeze(out), unsqueeze(s)

    f = smap(body, mesh, (DATA, DATA), (DATA, DATA))
    return f(put(grads, mesh, DATA), lsgd_jax.replicate(hook.init(None), mesh))[0]


# --- 2. empty leaves -----------------------------------------------------------------

STATELESS = [
    comm.flat(),
    comm.finite_only(),
    comm.compressed(),
    comm.two_level(),
    comm.quantized(8, error_feedback=False),
    comm.quantized(4, two_level=True, error_feedback=False),
]
WITH_STATE = [comm.quantized(8), comm.quantized(4, two_level=True)]


def check_mean(out, values, exact):
    for name, x in values.items():
        got, x = np.asarray(out[name]), np.asarray(x)
        assert got.shape == x.shape and got.dtype == x.dtype, name
        if not jnp.issubdtype(x.dtype, jnp.floating):
            np.testing.assert_array_equal(got, x)  # not averaged
        elif x.size:
            want = np.broadcast_to(x.astype(np.float64).mean(0), x.shape)
            # Rounded ones: bfloat16, or a 4-bit step of absmax / 7.
            atol = 1e-6 if exact else 0.15 * np.abs(x).max()
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=atol)


@pytest.mark.parametrize("strategy", STATELESS + WITH_STATE, ids=repr)
def test_every_strategy_averages_trees_with_empty_leaves(strategy):
    exact = isinstance(strategy, (comm.Flat, comm.FiniteOnly, comm.TwoLevel))
    w = jnp.arange(N * 6, dtype=jnp.float32).reshape(N, 6) / 7
    some = {"w": w, "empty": jnp.zeros((N, 0))}
    none = {"empty": jnp.zeros((N, 0)), "e2": jnp.zeros((N, 3, 0)), "n": jnp.ones((N, 3), int)}
    for values in (some, none):
        check_mean(averaged(strategy, values), values, exact)
        if strategy in STATELESS:
            check_mean(hooked(strategy, values), values, exact)


# --- 3. device order -----------------------------------------------------------------


def reordered(mesh):
    """``mesh`` with its devices in reverse order along both data axes."""
    devices = np.flip(mesh.devices, axis=(0, 1))
    return Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)


def on_mesh(x, mesh):
    """``x`` as an array over ``mesh`` made of the same per-device buffers."""
    sharding = NamedSharding(mesh, x.sharding.spec)
    buffers = {s.device: s.data for s in x.addressable_shards}
    devices = sharding.addressable_devices_indices_map(x.shape)
    return jax.make_array_from_single_device_arrays(
        x.shape, sharding, [buffers[d] for d in devices]
    )


def by_device(x):
    """{device id: this device's row} of a per-replica array."""
    return {s.device.id: np.asarray(s.data)[0] for s in x.addressable_shards}


def mean_program(strategy, mesh):
    def body(x, r):
        state = None if r is None else r[0]
        out = comm.apply(strategy, x[0], GLOBAL, state)
        return out.value[None], (None if r is None else out.state[None])

    return smap(body, mesh, (DATA, DATA), (DATA, DATA))


@pytest.mark.parametrize("two_level", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("error_feedback", [False, True])
def test_a_quantized_mean_does_not_depend_on_the_device_order(bits, two_level, error_feedback):
    # The same replicas (each device keeps its buffers) on a mesh that lists the devices
    # in reverse order: every mean is the same, up to the order of the float32 sums.
    strategy = comm.quantized(bits, 4, error_feedback=error_feedback, two_level=two_level)
    one, other = mesh_2x4(), reordered(mesh_2x4())
    f, g = mean_program(strategy, one), mean_program(strategy, other)
    rng = np.random.default_rng(bits + 2 * two_level)
    residual = put(jnp.zeros((N, 96)), one, DATA) if error_feedback else None
    for call in range(4):
        scale = 10.0 ** rng.uniform(-2, 2, size=(1, 96))
        x = put(jnp.asarray((rng.normal(size=(N, 96)) * scale).astype(np.float32)), one, DATA)
        mean, new = f(x, residual)
        mean2, new2 = g(on_mesh(x, other), None if residual is None else on_mesh(residual, other))
        a, b = by_device(mean), by_device(mean2)
        assert a.keys() == b.keys()
        inputs = np.abs(np.asarray(x)) + (0 if residual is None else np.abs(np.asarray(residual)))
        # A few float32 roundings of each block's largest input (blocks of 4 values).
        tol = np.repeat(inputs.reshape(N, -1, 4).max((0, 2)), 4) * 1e-5
        for d in a:
            assert (np.abs(a[d] - b[d]) <= tol).all(), (call, d, np.abs(a[d] - b[d]).max())
        if error_feedback:
            # The residuals sum to the same total error (what the next means send).
            ra, rb = by_device(new), by_device(new2)
            total_a, total_b = sum(ra.values()), sum(rb.values())
            assert (np.abs(total_a - total_b) <= 8 * tol).all(), np.abs(total_a - total_b).max()
            residual = new  # both meshes carry the same per-replica residual on


# --- 4. inner axis -------------------------------------------------------------------


@pytest.mark.parametrize(
    "strategy",
    [comm.two_level("lcoal"), comm.quantized(two_level=True, inner_axis="lcoal")],
    ids=repr,
)
def test_an_inner_axis_that_is_not_a_mesh_axis_is_an_error(strategy):
    values = {"w": jnp.ones((N, 6))}
    with pytest.raises(ValueError, match=r"'lcoal'.*\('node', 'local'\).*inner_axis"):
        averaged(strategy, values)
    if isinstance(strategy, comm.TwoLevel):  # the hook refuses quantized with a residual
        with pytest.raises(ValueError, match="'lcoal'"):
            hooked(strategy, values)


def test_an_inner_axis_outside_the_group_takes_the_one_level_path():
    # A group without the node's axis (but the axis is bound): one level, no error; and
    # under pmap an IndexGroups group takes the one-level path whatever the inner axis.
    x = jnp.arange(N * 4, dtype=jnp.float32).reshape(N, 4)
    for strategy in (comm.two_level(), comm.quantized(8, two_level=True, error_feedback=False)):
        f = smap(
            lambda v, s=strategy: comm.apply(s, v[0], ("node",)).value[None],
            mesh_2x4(),
            DATA,
            DATA,
        )
        got = np.asarray(f(put(x, mesh_2x4(), DATA)))
        want = np.asarray(x).reshape(2, 4, 4).mean(0)
        np.testing.assert_allclose(got, np.concatenate([want, want]), atol=0.5)
    groups = lsgd_jax.node_groups("batch", devices_per_node=4)
    for strategy in (comm.two_level("lcoal"), comm.quantized(two_level=True, inner_axis="lcoal")):
        out = jax.pmap(lambda v, s=strategy: comm.apply(s, v, groups).value, axis_name="batch")(x)
        np.testing.assert_allclose(out[:4], np.broadcast_to(x[:4].mean(0), (4, 4)), atol=0.5)


# --- 9. padding ----------------------------------------------------------------------


_WIRE: dict = {}


def wire_bytes(strategy, shapes, where="all"):
    """Bytes each device sends over links in one compiled average of float32 ``shapes``:
    in all its collectives, or (``where="across"``) in those that span nodes."""
    key = (strategy, tuple(shapes.items()))
    if key not in _WIRE:
        _WIRE[key] = _wire_bytes(strategy, shapes)
    return _WIRE[key][where]


def _wire_bytes(strategy, shapes):
    mesh = mesh_2x4()
    averager = lsgd_jax.PeriodicModelAverager(2, communication=strategy)
    sharding = NamedSharding(mesh, DATA)
    params = {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}

    def abstract(x):
        return jax.ShapeDtypeStruct((N, *jnp.shape(x)), jnp.result_type(x), sharding=sharding)

    def body(params, state):
        p, s = averager.average_parameters(squeeze(params), squeeze(state))
        return unsqueeze(p), unsqueeze(s)

    f = smap(body, mesh, (DATA, DATA), (DATA, DATA))
    args = jax.tree.map(abstract, (params, averager.init(params)))
    report = lsgd_jax.communication_report(f, *args, mesh=mesh)
    averaging = [c for c in report if c.scope == "model_averaging"]
    return {
        "all": sum(c.wire_bytes for c in averaging),
        "across": sum(c.wire_bytes for c in averaging if crosses_nodes(c, ("local",))),
    }


SIZES = [{"w": (14,)}, {"w": (1,)}, {"a": (3, 5), "b": (40,)}, {"w": (1000,)}]


@pytest.mark.parametrize("shapes", SIZES, ids=str)
@pytest.mark.parametrize(
    "strategy",
    [
        comm.quantized(8),
        comm.quantized(4),
        comm.quantized(8, two_level=True),
        comm.quantized(4, 1 << 16, two_level=True),
        comm.quantized(8, 1 << 16),
    ],
    ids=repr,
)
def test_a_quantized_mean_never_sends_more_than_its_float32_mean(strategy, shapes):
    # One level: no more than one float32 all-reduce. Two levels (issue 26): no more
    # across nodes than comm.two_level() (it sent one flat all-reduce where quantizing
    # did not pay: 4 to 7 times the bytes across nodes for trees up to a few thousand
    # values); inside a node both reduce-scatter and all-gather in float32.
    if strategy.two_level:
        two_level = wire_bytes(comm.two_level(), shapes, "across")
        assert wire_bytes(strategy, shapes, "across") <= two_level
    else:
        assert wire_bytes(strategy, shapes) <= wire_bytes(comm.flat(), shapes)


def test_a_small_tree_costs_what_its_values_cost_and_stays_exact_when_not_quantized():
    # 14 values: 612 bytes into the collectives per device before (a 512-value padded
    # buffer), against 98 wire bytes for the float32 all-reduce.
    assert wire_bytes(comm.quantized(8), {"w": (14,)}) < wire_bytes(comm.flat(), {"w": (14,)})
    big = {"w": (5000,)}
    # A huge block is capped to the chunk: the bytes follow the values, not the block.
    assert wire_bytes(comm.quantized(8, 1 << 16), big) < 0.3 * wire_bytes(comm.flat(), big)
    # One value: quantizing would cost more than sending it; the mean is exact.
    values = {"w": jnp.arange(N, dtype=jnp.float32)[:, None] / 3}
    out = averaged(comm.quantized(8), values)
    np.testing.assert_allclose(np.asarray(out["w"]), 3.5 / 3, rtol=1e-6)


def test_a_huge_block_size_is_refused():
    with pytest.raises(ValueError, match=r"block_size must be at most .*got 1099511627776"):
        comm.quantized(block_size=2**40)
    with pytest.raises(ValueError, match="block_size must be at most"):
        comm.Quantized(8, 2**40)


# --- 10. validation ------------------------------------------------------------------


def test_strategy_arguments_are_checked_however_the_strategy_is_built():
    with pytest.raises(ValueError, match=r"got None.*jnp\.bfloat16"):
        comm.compressed(None)
    for wide in (jnp.float32, jnp.float64):
        with pytest.raises(ValueError, match=rf"narrower than float32.*{jnp.dtype(wide).name}"):
            comm.compressed(wide)
        with pytest.raises(ValueError, match="narrower than float32"):
            comm.Compressed(wide)
    with pytest.raises(ValueError, match="floating dtype"):
        comm.Compressed(jnp.int8)
    assert comm.compressed(jnp.float16).dtype == jnp.float16
    for bad in (None, 3, ("local",)):
        with pytest.raises(TypeError, match="inner_axis must be a mesh axis name"):
            comm.TwoLevel(bad)
        with pytest.raises(TypeError, match="inner_axis must be a mesh axis name"):
            comm.two_level(bad)
    with pytest.raises(ValueError, match="finite_only policy"):
        comm.FiniteOnly("propagate")
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        comm.Quantized(bits=2)
