"""One process of tests/test_elastic.py's resume check (run as a script: it needs a
fresh JAX backend for lsgd_jax.elastic.initialize)."""

import json
import sys

import lsgd_jax.elastic as elastic

elastic.initialize(f"127.0.0.1:{sys.argv[1]}", 1, 0, num_cpu_devices=2)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import lsgd_jax  # noqa: E402

W = np.array([[1.0], [-2.0], [0.5]], np.float32)


def batch_fn(step, layout):
    x = np.random.default_rng(step).standard_normal((4 * layout.devices_per_process, 3))
    return {"x": x.astype(np.float32), "y": (x @ W).astype(np.float32)}


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def make_loop():
    tx = optax.chain(
        lsgd_jax.post_local_sgd(2),
        optax.sgd(0.1, momentum=0.9),
        lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(3, 2)),
    )
    return elastic.ElasticLoop(loss_fn, tx, {"w": np.zeros((3, 1), np.float32)}, batch_fn)


loop = make_loop()
first = loop.run(5)
errors = []
for kwargs in ({}, {"first_step": 12}):
    try:
        loop.run(12, **kwargs)
    except ValueError as e:
        errors.append(str(e))
rest = loop.run(12, first_step=5, initial_state=(first.params, first.opt_state))
whole = make_loop().run(12)
import jax  # noqa: E402

pairs = zip(jax.tree.leaves(rest.opt_state), jax.tree.leaves(whole.opt_state))
result = {
    "equal": bool(np.array_equal(np.asarray(rest.params["w"]), np.asarray(whole.params["w"]))),
    "steps": [r.step for r in first.records + rest.records],
    "state_equal": all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs),
    "errors": errors,
}
print("RESULT", json.dumps(result), flush=True)
loop.shutdown()
