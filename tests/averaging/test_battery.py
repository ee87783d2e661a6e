"""One battery over every communication strategy and both averagers (as optax's common
test runs over every optimizer): what each pair promises, asked the same way (issue 28).

For each strategy x averager, on the 2 x 4 mesh, through ``model_averaging`` in a chain
under ``data_parallel_step``'s shard_map: the state keeps its tree structure, shapes and
dtypes across calls; a global average leaves every replica with the same params, the
replicas' mean within what the strategy says it rounds (and the last bit of
``params + (mean - params)``, optax's way of setting params); a node-level average keeps the
nodes apart; the step is deterministic; and what the strategy answers (``may_skip``,
``rounds_small_values``, ``alongside``) matches what its state and numbers show.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import DATA, mesh_2x4, put, smap, squeeze, unsqueeze

import lsgd_jax
from lsgd_jax import comm

STRATEGIES = [
    comm.flat(),
    comm.finite_only("exclude"),
    comm.finite_only("skip"),
    comm.two_level(),
    comm.compressed(jnp.bfloat16),
    comm.quantized(8, error_feedback=False),
    comm.quantized(4, error_feedback=False),
    comm.quantized(8),
    comm.quantized(4, two_level=True),
    comm.quantized(8, two_level=True, error_feedback=False),
]
AVERAGERS = {
    "periodic": lambda c: lsgd_jax.PeriodicModelAverager(2, communication=c),
    "hierarchical": lambda c: lsgd_jax.HierarchicalModelAverager(
        {2: "local", 4: ("node", "local")}, communication=c
    ),
}
N = 8  # replicas


def values():
    """Per-replica params: each replica different, one leaf of another dtype (int, not
    averaged), one empty leaf; small entries next to large ones in the same block."""
    r = jnp.arange(N, dtype=jnp.float32)[:, None]
    w = (r + 1) * jnp.linspace(-1.0, 1.0, 96)[None, :] / 3
    w = w.at[:, 0].set(1e-4 * (r[:, 0] + 1))  # small next to large
    return {
        "w": w.reshape(N, 8, 12),
        "b": r * 0.25 + 0.1,
        "n": jnp.ones((N, 3), jnp.int32),
        "e": jnp.zeros((N, 0)),
    }


def run_calls(averager, params, num_calls):
    """``num_calls`` calls of ``model_averaging(averager)`` with zero updates; returns the
    params and state after each call (as NumPy trees) and the state's tree structures."""
    mesh = mesh_2x4()
    tx = lsgd_jax.model_averaging(averager)

    def body(p, s):
        zero = jax.tree.map(jnp.zeros_like, squeeze(p))
        updates, s = tx.update(zero, squeeze(s), squeeze(p))
        return unsqueeze(optax.apply_updates(squeeze(p), updates)), unsqueeze(s)

    f = smap(body, mesh, (DATA, DATA), (DATA, DATA))
    p = put(params, mesh, DATA)
    s = lsgd_jax.replicate(tx.init(squeeze(params)), mesh)
    out = []
    for _ in range(num_calls):
        p, s = f(p, s)
        out.append(jax.tree.map(np.asarray, (p, s)))
    return out, jax.tree.structure(lsgd_jax.replicate(tx.init(squeeze(params)), mesh))


def tolerance(strategy, x):
    """What a mean of ``x`` may be off by, from what the strategy says it does."""
    if strategy.rounds_small_values:  # integers with block scales: a step of absmax
        bits = strategy.bits
        return 1.5 * np.abs(x).max() / (2 ** (bits - 1) - 1)
    if isinstance(strategy, comm.Compressed):
        return 2**-7 * np.abs(x).max()  # bfloat16's rounding
    return 1e-6


@pytest.mark.parametrize("strategy", STRATEGIES, ids=repr)
@pytest.mark.parametrize("kind", list(AVERAGERS))
def test_every_strategy_with_every_averager_keeps_its_promises(strategy, kind):
    averager = AVERAGERS[kind](strategy)
    params = values()
    calls, structure = run_calls(averager, params, 5)
    levels = [averager.level(s) for s in range(5)]  # e.g. periodic 1,0,1,0,1
    states = [None] + [c[1] for c in calls]
    for (p, s), level, before, prior in zip(
        calls, levels, [params] + [c[0] for c in calls], states
    ):
        # the state and params keep their structure, shapes and dtypes
        assert jax.tree.structure(s) == structure
        for got, x in zip(jax.tree.leaves(p), jax.tree.leaves(params)):
            assert got.shape == x.shape and got.dtype == x.dtype
        np.testing.assert_array_equal(p["n"], params["n"])  # integers are not averaged
        if not level:
            for got, x in zip(jax.tree.leaves(p), jax.tree.leaves(before)):
                np.testing.assert_array_equal(got, np.asarray(x))
            continue
        groups = [range(N)] if averager.is_global(level) else [range(0, 4), range(4, 8)]
        for name in ("w", "b"):
            x = np.asarray(before[name], np.float64)
            for g in groups:
                g = list(g)
                mean = x[g].mean(0)
                for r in g:  # every member receives the same mean (up to the rounding
                    # of params + (mean - params), optax's way of setting the params)
                    np.testing.assert_allclose(p[name][r], p[name][g[0]], rtol=0, atol=1e-6)
                # with error feedback, what the last mean left out is sent now
                carried = 0.0
                if prior is not None and prior.comm_state is not None:
                    carried = np.abs(np.asarray(prior.comm_state[name])[g]).max()
                atol = tolerance(strategy, x[g]) + carried
                np.testing.assert_allclose(p[name][g[0]], mean, rtol=0, atol=atol)
            if len(groups) == 2 and not np.allclose(x[:4].mean(0), x[4:].mean(0)):
                assert not np.array_equal(p[name][0], p[name][4])  # the nodes stay apart
    # deterministic: the same calls again give the same bits
    again, _ = run_calls(averager, params, 5)
    for (p1, s1), (p2, s2) in zip(calls, again):
        for a, b in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2))):
            np.testing.assert_array_equal(a, b)
    # what the strategy says of itself shows in the state
    state = calls[0][1]
    assert (state.skipped is not None) == strategy.may_skip
    assert (state.comm_state is not None) == bool(getattr(strategy, "error_feedback", False))
    assert not averager.communicator.alongside().rounds_small_values  # model state is safe
