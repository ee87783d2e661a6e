"""Communication strategies (lsgd_jax.comm): one keyword, the same numbers as the flags."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import DATA, mesh_2x4, put, rank_values, smap, squeeze, unsqueeze
from jax import lax

import lsgd_jax
from lsgd_jax import comm


def averaged(averager, values):
    mesh = mesh_2x4()

    def body(params, state):
        p, s = averager.average_parameters(squeeze(params), squeeze(state))
        return unsqueeze(p), unsqueeze(s)

    f = smap(body, mesh, (DATA, DATA), (DATA, DATA))
    state = lsgd_jax.replicate(averager.init(), mesh)
    return np.asarray(f(put(values, mesh, DATA), state)[0])


def poisoned():
    v = np.array(rank_values(8, (4,)))
    v[3] = np.nan
    return jnp.asarray(v)


@pytest.mark.parametrize(
    "flags, strategy",
    [
        ({}, comm.flat()),
        ({"nonfinite": "exclude"}, comm.finite_only("exclude")),
        ({"nonfinite": "skip"}, comm.finite_only("skip")),
        ({"communication_dtype": jnp.bfloat16}, comm.compressed(jnp.bfloat16)),
    ],
)
def test_a_strategy_gives_the_same_bits_as_its_flags(flags, strategy):
    by_flags = lsgd_jax.PeriodicModelAverager(2, **flags)
    by_strategy = lsgd_jax.PeriodicModelAverager(2, communication=strategy)
    assert by_flags.communicator == strategy == by_strategy.communicator
    values = poisoned() if "nonfinite" in flags else rank_values(8, (4,)) / 3
    np.testing.assert_array_equal(averaged(by_flags, values), averaged(by_strategy, values))


def test_flags_and_a_strategy_together_are_refused():
    with pytest.raises(ValueError, match="either communication= or nonfinite="):
        lsgd_jax.PeriodicModelAverager(2, nonfinite="skip", communication=comm.flat())
    with pytest.raises(TypeError, match="lsgd_jax.comm strategy"):
        lsgd_jax.HierarchicalModelAverager({2: ("node", "local")}, communication="bf16")
    with pytest.raises(TypeError, match="lsgd_jax.comm strategy"):
        lsgd_jax.post_local_sgd(4, communication=jnp.bfloat16)
    with pytest.raises(ValueError, match="finite_only policy"):
        comm.finite_only("propagate")
    with pytest.raises(ValueError, match="floating dtype"):
        comm.compressed(jnp.int8)


@dataclasses.dataclass(frozen=True)
class CountingMean(comm.Communication):
    """A strategy written outside the library: lax.pmean, scaled to show it ran."""

    scale: float = 2.0

    def mean(self, tree, group, state=None, *, cast=True, step=None):
        out = jax.tree.map(lambda x: self.scale * lax.pmean(x, group), tree)
        return comm.Mean(out, None, state)

    def init(self, tree):
        return None


def test_the_hook_and_the_averagers_take_any_strategy():
    mesh = mesh_2x4()
    hook = lsgd_jax.post_local_sgd(1, communication=CountingMean())
    state = hook.init(None)
    g = put(rank_values(8, (3,)), mesh, DATA)

    def body(g, s):
        out, s = hook.update(squeeze(g), squeeze(s))
        return unsqueeze(out), unsqueeze(s)

    f = smap(body, mesh, (DATA, DATA), (DATA, DATA))
    out, state = f(g, lsgd_jax.replicate(state, mesh))
    np.testing.assert_allclose(np.asarray(out), 2 * 3.5)  # global mean, scaled
    out, _ = f(g, state)
    np.testing.assert_allclose(np.asarray(out)[:4], 2 * 1.5)  # node-local mean, scaled
    avg = lsgd_jax.PeriodicModelAverager(2, communication=CountingMean(3.0))
    np.testing.assert_allclose(averaged(avg, rank_values(8, (3,))), 3 * 3.5)


def test_the_hook_sends_gradients_in_bfloat16_when_asked():
    mesh = mesh_2x4()
    tx = optax.chain(lsgd_jax.post_local_sgd(4, communication=comm.compressed()), optax.sgd(1.0))
    loss = lambda p, b: jnp.mean(b @ p)  # noqa: E731
    step = lsgd_jax.data_parallel_step(loss, tx, mesh)
    p = lsgd_jax.replicate(jnp.zeros(3), mesh)
    s = lsgd_jax.replicate(tx.init(jnp.zeros(3)), mesh)
    report = step.communication_report(p, s, jnp.ones((8, 3)))
    kinds = {(c.kind, c.scope) for c in report if c.scope == "post_localSGD_hook"}
    assert kinds == {("all-to-all", "post_localSGD_hook"), ("all-gather", "post_localSGD_hook")}
    rows = jnp.arange(8.0)[:, None] * jnp.full((8, 3), 1 / 3)
    p, s, _ = step(p, s, rows)
    np.testing.assert_allclose(np.asarray(p), -3.5 / 3, rtol=1e-2)  # bf16-rounded mean
