"""The run recorded from PyTorch (data/torch_post_local_sgd_periodic.json): its config,
data, trajectory, and a runner that reproduces it on a (2, 2) mesh; see data/README.md."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from helpers import put, smap, squeeze, unsqueeze
from jax.sharding import PartitionSpec as P

import lsgd_jax

REF = json.loads(
    (
        pathlib.Path(__file__).resolve().parent / "data" / "torch_post_local_sgd_periodic.json"
    ).read_text()
)
CFG = REF["config"]
NAMES = ("w1", "b1", "w2", "b2")
D = P(("node", "local"))


def loss_fn(params, x, y):
    pred = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
    return jnp.mean((pred - y) ** 2)


def batches():
    """Every step's data, shape [steps, world, batch, ...], generated as PyTorch did."""
    xs, ys = [], []
    for s in range(CFG["steps"]):
        xr, yr = [], []
        for r in range(CFG["world"]):
            rng = np.random.default_rng([CFG["seed"], r, s])
            x = rng.standard_normal((CFG["batch"], CFG["din"])).astype(np.float32)
            noise = 0.1 * rng.standard_normal((CFG["batch"], 1))
            y = (np.sin(x.sum(axis=1, keepdims=True)) + noise).astype(np.float32)
            xr.append(x)
            yr.append(y)
        xs.append(xr)
        ys.append(yr)
    return np.array(xs), np.array(ys)


def reference():
    """[steps, world] arrays per param name."""
    t = REF["trajectory"]
    return {
        n: np.array(
            [[t[r][s][n] for r in range(CFG["world"])] for s in range(CFG["steps"])], np.float32
        )
        for n in NAMES
    }


def init_params():
    return {n: np.array(REF["init"][n], np.float32) for n in NAMES}


def mesh_2x2():
    assert CFG["world"] == 4 and CFG["local"] == 2 and CFG["averager"] == "periodic"
    return lsgd_jax.make_mesh(num_nodes=CFG["world"] // CFG["local"], devices_per_node=CFG["local"])


def run(step_body, state, per_replica_state):
    """Runs every step; returns [steps, world] params per name.

    ``per_replica_state``: every state leaf carries a leading replica axis. Otherwise the
    step counters (int32 scalars) are replicated with ``P()`` and only the optimizer's
    float state (momentum) is per replica.
    """
    mesh = mesh_2x2()
    xs, ys = batches()
    params = lsgd_jax.replicate(init_params(), mesh)
    specs = jax.tree.map(
        lambda x: (
            D if per_replica_state or jnp.ndim(x) or jnp.issubdtype(x.dtype, jnp.floating) else P()
        ),
        state,
    )
    state = jax.tree.map(
        lambda x, spec: lsgd_jax.replicate(x, mesh) if spec == D else put(x, mesh, P()),
        state,
        specs,
    )

    def body(params, state, x, y):
        state = jax.tree.map(lambda v, spec: v[0] if spec == D else v, state, specs)
        p, s = step_body(squeeze(params), state, x[0], y[0])
        return unsqueeze(p), jax.tree.map(lambda v, spec: v[None] if spec == D else v, s, specs)

    f = smap(body, mesh, (D, specs, D, D), (D, specs))
    out = {n: [] for n in NAMES}
    for s in range(CFG["steps"]):
        params, state = f(params, state, put(xs[s], mesh, D), put(ys[s], mesh, D))
        for n in NAMES:
            out[n].append(np.asarray(params[n]))
    return {n: np.array(v) for n, v in out.items()}


def check(traj):
    ref = reference()
    worst = max(float(np.max(np.abs(traj[n] - ref[n]))) for n in NAMES)
    per_step = [
        max(float(np.max(np.abs(traj[n][s] - ref[n][s]))) for n in NAMES)
        for s in range(CFG["steps"])
    ]
    assert max(per_step) <= 1e-5, f"max |diff| per step: {per_step}"
    # The recorded run really does diverge between averages (so the test can fail).
    spread = max(float(np.ptp(ref[n][CFG["start"] + 1], axis=0).max()) for n in NAMES)
    assert spread > 1e-4
    return worst


def hook_state():
    return lsgd_jax.PostLocalSGDState(
        None,
        "local",
        CFG["start"],
        post_local_gradient_allreduce=CFG["post_local_gradient_allreduce"],
    )


def averager():
    return lsgd_jax.PeriodicModelAverager(CFG["period"], warmup_steps=CFG["warmup"])
