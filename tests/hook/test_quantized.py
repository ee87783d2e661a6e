"""post_local_sgd with comm.quantized(): the hook's gradient means sent as 8- or 4-bit
integers with error feedback, the residual in the hook's state.

The reference is a NumPy replay written from ``comm.quantized``'s docstring: the floating
leaves flattened into one float32 buffer plus this replica's residual, cut into one chunk
per replica (whole blocks of at most ``block_size`` values, a block never longer than a
chunk), each block sent as ``round(x / s)`` with ``s = max|x| / qmax``; stage 1 hands
each replica its chunk from every peer (an all-to-all), which it decodes, sums and
divides; stage 2 quantizes that chunk mean again and gathers it to everyone. The
residual keeps each replica's stage-1 error on every chunk and ``g`` times the stage-2
error of the chunk it summed. ``two_level``: a float32 reduce-scatter inside the node,
the quantized mean of each device's shard of the node's sum across nodes, a float32
all-gather; a mean that never leaves the node is a plain float32 mean and leaves the
residual alone. Where quantizing would send as many bytes as a float32 ring all-reduce
or more, the mean is that all-reduce (exact) and the residual becomes zero.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import DATA, mesh_2x4, put, smap, squeeze, types_of, unsqueeze
from jax import lax
from jax.sharding import PartitionSpec as P
from mp_worker import CFG, global_batch, init_params, loss_fn, train

import lsgd_jax
from lsgd_jax import comm

# the slow tier: 36 s on 2 workers (2026-12-01)
pytestmark = pytest.mark.slow

QMAX = {8: 127, 4: 7}
BLOCK = 64
SHAPES = {"a": (1000,), "b": (37, 40)}  # 2480 values: every chunk is padded
START, STEPS = 3, 6  # three global means (warm-up), then three node-local ones
MESHES = [(2, 4), (1, 8), (8, 1)]  # (nodes, devices per node)


# --- the NumPy replay ---------------------------------------------------------------------


def decoded(rows, bits, block):
    """What the receivers decode from ``rows`` (float32, last axis whole blocks).

    ``s = max|x| / qmax`` and ``x / s`` as XLA computes them, ``max|x| * (1 / qmax)``
    and ``x * (1 / s)``: that decides exact ties (``x / s = k + 1/2``, frequent where a
    few replicas' grid values are averaged) as the library's compiled code does.
    """
    qmax = QMAX[bits]
    blocks = rows.reshape(*rows.shape[:-1], -1, block)
    scale = np.abs(blocks).max(-1) * np.float32(1 / qmax)
    scale = np.where(scale == 0, np.float32(1), scale).astype(np.float32)[..., None]
    q = np.clip(np.round(blocks * (np.float32(1) / scale)), -qmax, qmax)
    return (q * scale).reshape(rows.shape).astype(np.float32)


def layout(length, inner, outer, bits):
    """(block, chunk, padded) of a quantized mean, or None where it is sent in float32:
    where the integers and scales (an all-to-all and an all-gather across ``outer``)
    would put no fewer bytes on the link they cross than a float32 ring all-reduce of
    the values crossing it (the node's shard, ``ceil(length / inner)`` values, with two
    levels: the float32 two-level mean's), as comm.quantized's docstring says."""
    if outer == 1:
        return None
    values = math.ceil(length / inner)
    share = math.ceil(values / outer)
    block = min(BLOCK, share + share % 2 if bits == 4 else share)
    chunk = math.ceil(share / block) * block
    padded = inner * outer * chunk
    chunk_bytes = chunk * bits // 8 + 4 * (chunk // block)
    quantized = 2 * (outer - 1) * chunk_bytes
    ring = 2 * (outer - 1) / outer * 4 * values
    return None if quantized >= ring else (block, chunk, padded)


def test_the_replays_layout_is_the_librarys_plan():
    """The replay's rule (written from the docs) against ``_quantize.plan`` over sizes
    and meshes, including the small two-level trees where the rule once charged the
    in-node float32 traffic and fell back to one flat float32 all-reduce: 520 values on
    2 x 4 now cross nodes as 2 x 136 bytes of int8 (issue 26)."""
    from lsgd_jax.comm import _quantize

    assert layout(520, 4, 2, 8) == (64, 128, 1024)
    for inner, outer in [(1, 8), (4, 2), (8, 2), (8, 8), (2, 4)]:
        for bits in (8, 4):
            for length in [1, 2, 7, 14, 63, 64, 65, 130, 520, 1000, 2480, 4124, 4125, 19477]:
                want = _quantize.plan(length, inner, outer, bits, BLOCK)
                got = layout(length, inner, outer, bits)
                assert got == (None if want is None else tuple(want)), (length, inner, outer)


def one_level(v, bits, block):
    """(mean, residuals) of the rows of ``v`` (g replicas in position order, padded)."""
    g = v.shape[0]
    rows = v.reshape(g, g, -1)  # [replica, chunk, values]
    sent = decoded(rows, bits, block)
    chunk_mean = sent.sum(0) / np.float32(g)  # chunk c is summed by the replica at c
    sent2 = decoded(chunk_mean, bits, block)
    residual = rows - sent
    for c in range(g):  # only the replica that summed a chunk knows its stage-2 error
        residual[c, c] += np.float32(g) * (chunk_mean[c] - sent2[c])
    return sent2.reshape(-1), residual.reshape(g, -1)


def exact(v):
    return np.broadcast_to(v.mean(0, dtype=np.float32), v.shape), np.zeros_like(v)


def pad(v, padded):
    return np.pad(v, ((0, 0), (0, padded - v.shape[1])))


def flat_mean(v, bits):
    """One level over the rows of ``v``: (means, residuals), one row per replica."""
    g, length = v.shape
    cut = layout(length, 1, g, bits)
    if cut is None:
        return exact(v)
    block, _, padded = cut
    mean, residual = one_level(pad(v, padded), bits, block)
    return np.broadcast_to(mean[:length], v.shape), residual[:, :length]


def two_level_mean(v, nodes, k, bits):
    """Two levels over all replicas (row-major: node, then device in the node)."""
    n, length = v.shape
    cut = layout(length, k, nodes, bits)
    if cut is None:
        return exact(v)
    block, chunk, padded = cut
    shard = nodes * chunk
    sums = pad(v, padded).reshape(nodes, k, k, shard).sum(1)  # [node, shard j, values]
    mean = np.zeros(padded, np.float32)
    residual = np.zeros((nodes, k, padded), np.float32)
    for j in range(k):  # device j of every node: shard j, quantized across nodes
        m, r = one_level(sums[:, j], bits, block)
        mean[j * shard : (j + 1) * shard] = m
        residual[:, j, j * shard : (j + 1) * shard] = r
    mean = mean / np.float32(k)
    return np.broadcast_to(mean[:length], v.shape), residual.reshape(n, padded)[:, :length]


def hook_mean(x, r, nodes, k, phase, bits, two_level):
    """One step of the hook, replayed: (gradients out, new residuals), (8, L) each."""
    if phase == "local" and two_level:  # never leaves the node: float32, residual kept
        return np.concatenate([exact(x[a * k : (a + 1) * k])[0] for a in range(nodes)]), r
    v = x + r
    if phase == "global":
        return two_level_mean(v, nodes, k, bits) if two_level else flat_mean(v, bits)
    out = [flat_mean(v[a * k : (a + 1) * k], bits) for a in range(nodes)]
    return np.concatenate([o for o, _ in out]), np.concatenate([r for _, r in out])


# --- the library's hook -------------------------------------------------------------------


def spread_grads(seed, steps=STEPS, n=8):
    """(steps, replicas, values) float32 whose blocks of 64 differ in size by up to 1e4."""
    rng = np.random.default_rng(seed)
    total = sum(math.prod(s) for s in SHAPES.values())
    scale = np.repeat(10.0 ** rng.uniform(-2, 2, -(-total // BLOCK)), BLOCK)[:total]
    return (rng.normal(size=(steps, n, total)) * scale).astype(np.float32)


def as_tree(flat):
    """(..., L) -> {"a": (..., 1000), "b": (..., 37, 40)}, in pack() order."""
    out, offset = {}, 0
    for name, shape in SHAPES.items():
        size = math.prod(shape)
        out[name] = flat[..., offset : offset + size].reshape(*flat.shape[:-1], *shape)
        offset += size
    return out


def as_flat(tree, lead):
    return np.concatenate(
        [np.asarray(tree[k], np.float32).reshape(*lead, -1) for k in SHAPES], axis=-1
    )


def run_hook(grads, nodes, k, strategy, post_local_gradient_allreduce=True):
    """The hook over ``grads`` (steps, 8, L) in one jitted scan: (outputs, final state)."""
    mesh = lsgd_jax.make_mesh(nodes, k)
    tx = lsgd_jax.post_local_sgd(
        START,
        communication=strategy,
        post_local_gradient_allreduce=post_local_gradient_allreduce,
    )
    params = as_tree(np.zeros(grads.shape[-1], np.float32))
    steps = P(None, ("node", "local"))

    def body(g, state):
        def one(s, g_t):
            before = types_of(s)
            out, s = tx.update(g_t, s)
            assert types_of(s) == before  # the residual keeps its types: a scan carry
            return s, out

        state, outs = lax.scan(one, squeeze(state), jax.tree.map(lambda x: x[:, 0], g))
        return jax.tree.map(lambda x: x[:, None], outs), unsqueeze(state)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(steps, DATA), out_specs=(steps, DATA)))
    g = jax.device_put(as_tree(grads), jax.NamedSharding(mesh, steps))
    outs, state = f(g, lsgd_jax.replicate(tx.init(params), mesh))
    return as_flat(outs, grads.shape[:2]), state


def block_tolerance(x, rel=1e-5):
    """``rel`` times the largest |value| in each value's block (of 64, from the start of
    the flat buffer), over the replicas: float32 sums in another order are within it,
    one quantization step (about max / 254 or max / 14) is far outside."""
    length = x.shape[-1]
    blocks = np.pad(np.abs(x), [(0, 0)] * (x.ndim - 1) + [(0, (-length) % BLOCK)])
    amax = blocks.reshape(*x.shape[:-1], -1, BLOCK).max(-1).max(-2)
    return rel * np.repeat(amax, BLOCK, -1)[..., None, :length]


def replay(grads, nodes, k, bits, two_level):
    residual = np.zeros_like(grads[0])
    outs = []
    for t in range(grads.shape[0]):
        phase = "global" if t < START else "local"
        out, residual = hook_mean(grads[t], residual, nodes, k, phase, bits, two_level)
        outs.append(out)
    return np.stack(outs), residual


@pytest.mark.parametrize("nodes, k", MESHES)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("two_level", [False, True])
def test_means_match_the_numpy_replay_and_telescope(nodes, k, bits, two_level):
    grads = spread_grads(seed=bits + 2 * two_level + nodes)
    strategy = comm.quantized(bits, two_level=two_level)
    got, state = run_hook(grads, nodes, k, strategy)
    want, want_residual = replay(grads, nodes, k, bits, two_level)
    tol = block_tolerance(grads)
    assert (np.abs(got - want) <= tol).all(), np.max(np.abs(got - want) / tol)
    residual = as_flat(state.comm_state, (8,))
    assert (np.abs(residual - want_residual) <= 8 * tol[-1]).all()
    np.testing.assert_array_equal(np.asarray(state.iter), START)
    # Every replica of a group got the same bytes.
    for t in range(STEPS):
        size = 8 if t < START else k
        groups = got[t].reshape(8 // size, size, -1)
        assert (groups == groups[:, :1]).all()
    # Not vacuous: where the warm-up means are quantized (all but two levels on one
    # node), they differ from the exact ones and leave a residual.
    if not (two_level and nodes == 1):
        assert np.abs(got[0, 0] - grads[0].mean(0)).max() > 100 * tol[0, 0].max()
        assert np.abs(replay(grads[:START], nodes, k, bits, two_level)[1]).max() > 0
    check_telescoping(grads, got, residual, nodes, k, two_level)


def check_telescoping(grads, got, residual, nodes, k, two_level):
    """Over all replicas and steps, across the switch from global to node-local means:
    the gradients the hook handed out plus the final residuals sum to the true ones."""
    true = grads.astype(np.float64).sum((0, 1))
    handed_out = got.astype(np.float64).sum((0, 1))
    tol = STEPS * 8 * block_tolerance(grads, 1e-6).max((0, 1))
    closed = np.abs(handed_out + residual.astype(np.float64).sum(0) - true)
    assert (closed <= tol).all(), np.max(closed / tol)
    # The residual is what closes it, except where none is left: a node of one device
    # takes its node-local mean exact (the residual goes out with it), and two levels
    # on one node never quantize.
    if (k == 1 and not two_level) or (nodes == 1 and two_level):
        assert not residual.any()
    else:
        assert (np.abs(handed_out - true) > 100 * tol).any()


def test_without_allreduce_after_the_switch_the_residual_waits():
    # post_local_gradient_allreduce=False: after the switch the gradients are untouched,
    # bit for bit, and the warm-up's residual stays as it was.
    grads = spread_grads(seed=21)
    got, state = run_hook(grads, 2, 4, comm.quantized(8), post_local_gradient_allreduce=False)
    want, residual = replay(grads[:START], 2, 4, 8, False)
    np.testing.assert_array_equal(got[START:], grads[START:])
    tol = block_tolerance(grads)
    assert (np.abs(got[:START] - want) <= tol[:START]).all()
    assert (np.abs(as_flat(state.comm_state, (8,)) - residual) <= 8 * tol[-1]).all()


# --- the state ----------------------------------------------------------------------------


def test_the_state_structure_follows_the_configuration():
    params = {"w": jnp.ones((3, 2), jnp.bfloat16), "n": jnp.int32(3), "b": jnp.zeros(4)}
    state = lsgd_jax.post_local_sgd(2, communication=comm.quantized(4)).init(params)
    residual = state.comm_state
    assert jax.tree.structure(residual) == jax.tree.structure(params)
    assert {k: (v.shape, v.dtype) for k, v in residual.items()} == {
        "w": ((3, 2), jnp.float32),  # float32 whatever the gradient's float dtype
        "n": ((), jnp.int32),  # not averaged, never changes
        "b": ((4,), jnp.float32),
    }
    assert not any(np.asarray(x).any() for x in jax.tree.leaves(residual))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    assert paths == [".iter", ".comm_state['b']", ".comm_state['n']", ".comm_state['w']"]
    again = jax.tree.unflatten(jax.tree.structure(state), jax.tree.leaves(state))
    assert again.communication == comm.quantized(4) and again.comm_state.keys() == params.keys()

    for strategy in (None, comm.flat(), comm.two_level(), comm.quantized(8, error_feedback=False)):
        plain = lsgd_jax.post_local_sgd(2, communication=strategy).init(params)
        assert plain.comm_state is None and len(jax.tree.leaves(plain)) == 1

    with pytest.raises(ValueError, match=r"state.init\(params\)"):
        lsgd_jax.post_local_sgd(2, communication=comm.quantized()).init(None)
    bare = lsgd_jax.PostLocalSGDState(None, None, 2, communication=comm.quantized())
    with pytest.raises(ValueError, match="this state has none"):
        lsgd_jax.post_localSGD_hook(bare, params)
    assert bare.init(params).comm_state.keys() == params.keys()


def test_a_state_shared_by_the_replicas_is_refused_with_error_feedback():
    tx = lsgd_jax.post_local_sgd(2, communication=comm.quantized(8))
    grads = jnp.asarray(spread_grads(seed=3, steps=1)[0])

    def body(g, s):
        out, s = tx.update(squeeze(g), s)
        return unsqueeze(out), s

    f = smap(body, mesh_2x4(), (DATA, P()), (DATA, P()))
    state = put(tx.init(grads[0]), mesh_2x4(), P())
    with pytest.raises(ValueError, match="pass the hook's state per replica"):
        f(put(grads, mesh_2x4(), DATA), state)


# --- inside data_parallel_step, and its checkpoints ---------------------------------------


def make_tx(strategy):
    start = CFG["start"]
    return optax.chain(
        lsgd_jax.post_local_sgd(start, communication=strategy),
        lsgd_jax.post_local_sgd_optimizer(
            optax.sgd(CFG["lr"], momentum=CFG["momentum"]),
            lsgd_jax.PeriodicModelAverager(CFG["period"], warmup_steps=start),
        ),
    )


def test_data_parallel_step_carries_the_residual_and_a_checkpoint_resumes_it(tmp_path):
    mesh = mesh_2x4()
    strategy = comm.quantized(8, two_level=True)
    p0 = init_params()

    def fresh(strategy=strategy):
        return {
            "params": lsgd_jax.replicate(p0, mesh),
            "opt_state": lsgd_jax.replicate(make_tx(strategy).init(p0), mesh),
        }

    def hook_state(state):
        return state["opt_state"][0]

    def on_step(s, state):
        if s + 1 == 3:  # in the warm-up: global quantized means, a residual in flight
            lsgd_jax.save_checkpoint(tmp_path, 3, state)

    step = lsgd_jax.data_parallel_step(loss_fn, make_tx(strategy), mesh)
    want = train(fresh(), step, 0, 8, global_batch, on_step)  # the switch at step 4
    residual = as_leaves(hook_state(want).comm_state)
    assert all(r.shape[0] == 8 and r.dtype == np.float32 for r in residual)
    assert any(r.any() for r in residual)
    assert any((r != r[:1]).any() for r in residual)  # per replica
    assert (np.asarray(hook_state(want).iter) == CFG["start"]).all()

    restored = lsgd_jax.restore_checkpoint(tmp_path, fresh(), strict=True)
    assert (np.asarray(hook_state(restored).iter) == 3).all()
    assert any(r.any() for r in as_leaves(hook_state(restored).comm_state))
    got = train(
        restored, lsgd_jax.data_parallel_step(loss_fn, make_tx(strategy), mesh), 3, 8, global_batch
    )
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(g, w)

    # A target built without error feedback has no residual to restore into: said so.
    no_ef = fresh(comm.quantized(8, two_level=True, error_feedback=False))
    with pytest.raises(ValueError, match="comm_state"):
        lsgd_jax.restore_checkpoint(tmp_path, no_ef, strict=True)
    # Error feedback changes the run (the same steps without it end elsewhere).
    other = train(
        no_ef,
        lsgd_jax.data_parallel_step(
            loss_fn, make_tx(comm.quantized(8, two_level=True, error_feedback=False)), mesh
        ),
        0,
        8,
        global_batch,
    )
    assert not np.array_equal(other["params"]["w1"], want["params"]["w1"])


def as_leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]
