"""A strategy author's contract (comm's docs, docs/internals.md): a strategy written
outside the library, with error feedback, runs in the hook and in the averagers through
``init``, ``keeps_state`` and ``mean`` alone, and matches a NumPy replay."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import DATA, mesh_2x4, put, smap, squeeze, unsqueeze
from jax import lax

import lsgd_jax
from lsgd_jax import comm


@dataclasses.dataclass(frozen=True)
class TopK(comm.Communication):
    """Sends each leaf's ``k`` largest values by magnitude (the rest as zeros), with
    error feedback: what was not sent is kept per replica and added to the next mean."""

    k: int = 2

    @property
    def keeps_state(self):
        return True

    def init(self, tree):
        return jax.tree.map(jnp.zeros_like, tree)

    def mean(self, tree, group, state=None, *, cast=True, step=None):
        def top(want):
            flat = want.reshape(-1)
            keep = jnp.zeros_like(flat).at[lax.top_k(jnp.abs(flat), self.k)[1]].set(1)
            return (flat * keep).reshape(want.shape)

        want = jax.tree.map(jnp.add, tree, state)
        sent = jax.tree.map(top, want)
        means = jax.tree.map(lambda x: lax.pmean(x, group), sent)
        return comm.Mean(means, None, jax.tree.map(jnp.subtract, want, sent))


def numpy_topk(x, k):
    out = np.zeros_like(x)
    idx = np.argsort(-np.abs(x), kind="stable")[:k]
    out[idx] = x[idx]
    return out


@pytest.mark.filterwarnings("ignore:When period is 1")
def test_a_stateful_strategy_written_elsewhere_averages_like_its_numpy_replay():
    mesh = mesh_2x4()
    averager = lsgd_jax.PeriodicModelAverager(1, communication=TopK(2))
    rng = np.random.default_rng(0)
    values = rng.normal(size=(8, 5)).astype(np.float32)
    state = lsgd_jax.replicate(averager.init(jnp.zeros(5)), mesh)
    assert state.comm_state.shape == (8, 5)  # the residual, per replica, from init

    def body(params, state):
        p, s = averager.average_parameters(squeeze(params), squeeze(state))
        return unsqueeze(p), unsqueeze(s)

    f = smap(body, mesh, (DATA, DATA), (DATA, DATA))
    params, residual = values.copy(), np.zeros_like(values)
    got_params, got_state = put(jnp.asarray(values), mesh, DATA), state
    for _ in range(3):
        want = params + residual
        sent = np.stack([numpy_topk(w, 2) for w in want])
        params, residual = np.broadcast_to(sent.mean(0), params.shape), want - sent
        got_params, got_state = f(got_params, got_state)
        np.testing.assert_allclose(np.asarray(got_params), params, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(got_state.comm_state), residual, atol=1e-6)
        params = params + 0.1  # each replica moves on before the next average
        got_params = got_params + 0.1


def test_the_hook_carries_a_declared_state():
    hook = lsgd_jax.post_local_sgd(2, communication=TopK(1))
    state = hook.init({"w": jnp.ones(4)})
    np.testing.assert_array_equal(state.comm_state["w"], np.zeros(4))


@dataclasses.dataclass(frozen=True)
class Undeclared(comm.Communication):
    """Keeps a state from init but does not say so (keeps_state left False)."""

    def mean(self, tree, group, state=None, *, cast=True, step=None):
        return comm.Mean(jax.tree.map(lambda x: lax.pmean(x, group), tree), None, state)

    def init(self, tree):
        return jax.tree.map(jnp.zeros_like, tree)


class Forgets(TopK):
    """Declares a state but returns none."""

    def init(self, tree):
        return None


def test_a_state_not_declared_is_refused_at_init_with_the_fix():
    averager = lsgd_jax.PeriodicModelAverager(2, communication=Undeclared())
    with pytest.raises(TypeError, match="keeps_state is False.*returns True"):
        averager.init(jnp.ones(3))
    with pytest.raises(TypeError, match="init returned None but keeps_state is True"):
        comm.initial_state(Forgets(), jnp.ones(3))


@pytest.mark.filterwarnings("ignore:When period is 1")
def test_a_stateful_strategy_averages_model_state_with_a_fresh_state():
    """Values averaged alongside the params (a model's statistics) get no error feedback:
    a stateful strategy's mean of them is given a fresh state each time (zeros), so here
    the model state after an average is the mean of each replica's top-k."""
    mesh = mesh_2x4()
    tx = optax.chain(
        lsgd_jax.post_local_sgd(0, post_local_gradient_allreduce=False),
        optax.sgd(0.0),
        lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(1, communication=TopK(1))),
    )

    def loss(params, model_state, batch):
        return jnp.sum(params["w"] * 0.0), {"stat": batch[0]}

    step = lsgd_jax.data_parallel_step(loss, tx, mesh, with_model_state=True)
    params = {"w": jnp.zeros(3)}
    p, s = lsgd_jax.replicate(params, mesh), lsgd_jax.replicate(tx.init(params), mesh)
    ms = lsgd_jax.replicate({"stat": jnp.zeros(3)}, mesh)
    rows = np.random.default_rng(3).normal(size=(8, 3)).astype(np.float32)
    p, ms, s, _ = step(p, ms, s, jnp.asarray(rows))
    want = np.stack([numpy_topk(r, 1) for r in rows]).mean(0)
    np.testing.assert_allclose(np.asarray(ms["stat"]), np.broadcast_to(want, (8, 3)), atol=1e-6)
