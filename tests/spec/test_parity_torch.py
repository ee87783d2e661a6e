"""Parity with PyTorch: every replica's params after every step of a recorded run.

``data/torch_post_local_sgd_periodic.json`` was recorded from PyTorch's own classes
(DDP + post_localSGD_hook, PostLocalSGDOptimizer(SGD momentum, PeriodicModelAverager)),
4 ranks, 2 per node; see ``data/README.md``. We reproduce it on a (2, 2) mesh.
"""

import jax
import numpy as np
import optax
import pytest
from torch_reference import (
    CFG,
    NAMES,
    averager,
    check,
    hook_state,
    init_params,
    loss_fn,
    run,
)

import lsgd_jax


@pytest.mark.parametrize("per_replica_state", [False, True])
def test_functional_path_matches_pytorch(per_replica_state):
    sgd = optax.sgd(CFG["lr"], momentum=CFG["momentum"])
    avg = averager()

    def step(params, state, x, y):
        hook, opt, avg_state = state
        grads = jax.grad(loss_fn)(params, x, y)
        grads, hook = lsgd_jax.post_localSGD_hook(hook, grads)
        updates, opt = sgd.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
        params, avg_state = avg.average_parameters(params, avg_state)
        return params, (hook, opt, avg_state)

    state = (hook_state(), sgd.init(init_params()), avg.init())
    worst = check(run(step, state, per_replica_state))
    print(f"functional path: max |diff| vs PyTorch = {worst:.2e}")


@pytest.mark.parametrize("per_replica_state", [False, True])
@pytest.mark.parametrize("form", ["chain", "post_local_sgd_optimizer"])
def test_optax_path_matches_pytorch(form, per_replica_state):
    sgd = optax.sgd(CFG["lr"], momentum=CFG["momentum"])
    hook = lsgd_jax.post_local_sgd(
        CFG["start"],
        subgroup="local",
        post_local_gradient_allreduce=CFG["post_local_gradient_allreduce"],
    )
    if form == "chain":
        tx = optax.chain(hook, sgd, lsgd_jax.model_averaging(averager()))
    else:
        tx = optax.chain(hook, lsgd_jax.post_local_sgd_optimizer(sgd, averager()))

    def step(params, opt_state, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    worst = check(run(step, tx.init(init_params()), per_replica_state))
    print(f"optax path ({form}): max |diff| vs PyTorch = {worst:.2e}")


def test_two_level_means_follow_pytorch_and_the_flat_means():
    # comm.two_level() on the hook's global phase and the averager: the same numbers as
    # the flat all-reduce up to the order of the float sums.
    sgd = optax.sgd(CFG["lr"], momentum=CFG["momentum"])
    two = lsgd_jax.comm.two_level()
    avg = lsgd_jax.PeriodicModelAverager(CFG["period"], CFG["warmup"], communication=two)
    hook = lsgd_jax.post_local_sgd(
        CFG["start"],
        subgroup="local",
        post_local_gradient_allreduce=CFG["post_local_gradient_allreduce"],
        communication=two,
    )
    tx = optax.chain(hook, sgd, lsgd_jax.model_averaging(avg))
    flat = optax.chain(
        lsgd_jax.post_local_sgd(
            CFG["start"],
            subgroup="local",
            post_local_gradient_allreduce=CFG["post_local_gradient_allreduce"],
        ),
        sgd,
        lsgd_jax.model_averaging(averager()),
    )

    def stepper(t):
        def step(params, opt_state, x, y):
            grads = jax.grad(loss_fn)(params, x, y)
            updates, opt_state = t.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return step

    got = run(stepper(tx), tx.init(init_params()), True)
    want = run(stepper(flat), flat.init(init_params()), True)
    worst = check(got)
    diff = max(float(np.max(np.abs(got[n] - want[n]))) for n in NAMES)
    assert diff <= 1e-6, diff
    print(f"two-level: max |diff| vs PyTorch {worst:.2e}, vs flat {diff:.2e}")
