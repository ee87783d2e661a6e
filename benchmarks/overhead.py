"""What the library costs: an lsgd_jax step against a hand-written step, same collectives.

Run: python benchmarks/overhead.py [--reps 30]

On 8 simulated CPU devices (2 nodes x 4), for a small MLP and a ~10M-parameter MLP, it
times three phases of a training step built with lsgd_jax.data_parallel_step and
`optax.chain(post_local_sgd, sgd(momentum), model_averaging(PeriodicModelAverager))`:

- before the switch (global gradient mean),
- after the switch, a step that does not average (node-local gradient mean),
- after the switch, an averaging step (node-local gradient mean + global model mean),

against a hand-written shard_map step per phase that does the same math with plain
`lax.pmean` and no conditionals (the phase is chosen in Python, one jitted function
each). A repetition is a block of 4 steps run as a training loop runs them (each fed
the previous step's outputs, dispatched without waiting); blocks are interleaved (lsgd,
hand, lsgd, hand, ...). The library's step is configured to stay in one phase (a
warm-up that never ends, or period 1). The table reports medians of the per-step time
and the median of the per-pair ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import jax

if os.environ.get("LSGD_BENCH_PLATFORM", "cpu") == "cpu":
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import lsgd_jax  # noqa: E402

D = P(("node", "local"))
LR, MOMENTUM, PERIOD = 0.01, 0.9, 4


def mlp(sizes, key):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:])
    ]


def loss_fn(params, batch):
    h = batch["x"]
    for layer in params[:-1]:
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    out = h @ params[-1]["w"] + params[-1]["b"]
    return jnp.mean((out - batch["y"]) ** 2)


def hand_step(mesh, phase):
    """The same math, written by hand: one jitted function per phase, no cond."""
    sgd = optax.sgd(LR, momentum=MOMENTUM)

    def body(params, opt_state, batch):
        params, opt_state = jax.tree.map(lambda x: x[0], (params, opt_state))
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        axes = ("node", "local") if phase == "before" else "local"
        grads = lax.pmean(grads, axes)
        updates, opt_state = sgd.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if phase == "average":
            params = lax.pmean(params, ("node", "local"))
        loss = lax.pmean(loss, ("node", "local"))
        return jax.tree.map(lambda x: x[None], (params, opt_state)) + (loss,)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(D, D, D), out_specs=(D, D, P())))


def lsgd_step(mesh, phase, specialize=True):
    """The library's step, configured so that every call stays in ``phase``."""
    start = 10**6 if phase == "before" else 0
    if phase == "average":  # period 1: an average on every step
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            averager = lsgd_jax.PeriodicModelAverager(1)
    else:  # its warm-up never ends: no average
        averager = lsgd_jax.PeriodicModelAverager(PERIOD, warmup_steps=10**6)
    tx = optax.chain(
        lsgd_jax.post_local_sgd(start),
        optax.sgd(LR, momentum=MOMENTUM),
        lsgd_jax.model_averaging(averager),
    )
    step = lsgd_jax.data_parallel_step(
        loss_fn, tx, mesh, donate=False, max_in_flight=None, specialize=specialize
    )
    return step, tx


def timed_block(f, params, opt_state, batch, k):
    """``k`` steps as a training loop runs them (each fed the last one's outputs,
    dispatched without waiting), then waits: seconds per step, and the last state."""
    t0 = time.perf_counter()
    for _ in range(k):
        params, opt_state, _ = f(params, opt_state, batch)
    jax.block_until_ready((params, opt_state))
    return (time.perf_counter() - t0) / k, params, opt_state


def bench(
    name,
    sizes,
    batch_per_replica,
    reps,
    mesh,
    phases=("before", "local", "average"),
    specialize=True,
    block=4,
):
    params = mlp(sizes, jax.random.key(0))
    n = mesh.devices.size
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.standard_normal((n * batch_per_replica, sizes[0]), np.float32),
        "y": rng.standard_normal((n * batch_per_replica, sizes[-1]), np.float32),
    }
    batch = jax.device_put(batch, NamedSharding(mesh, D))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    rows = []
    for phase in phases:
        step, tx = lsgd_step(mesh, phase, specialize)
        p, s = lsgd_jax.replicate(params, mesh), lsgd_jax.replicate(tx.init(params), mesh)
        hand = hand_step(mesh, phase)
        hp = lsgd_jax.replicate(params, mesh)
        hs = lsgd_jax.replicate(optax.sgd(LR, momentum=MOMENTUM).init(params), mesh)
        # the two compute the same thing
        a, b = step(p, s, batch)[0], hand(hp, hs, batch)[0]
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-6)
        for _ in range(2):  # warm up
            _, p, s = timed_block(step, p, s, batch, block)
            _, hp, hs = timed_block(hand, hp, hs, batch, block)
        ts_l, ts_h = [], []
        for _ in range(reps):
            t, p, s = timed_block(step, p, s, batch, block)
            ts_l.append(t)
            t, hp, hs = timed_block(hand, hp, hs, batch, block)
            ts_h.append(t)
        ratios = [a / b for a, b in zip(ts_l, ts_h)]
        q = statistics.quantiles(ratios, n=4)
        rows.append(
            (
                name,
                f"{n_params:,}",
                phase,
                statistics.median(ts_l) * 1e3,
                statistics.median(ts_h) * 1e3,
                statistics.median(ratios),
                q[0],
                q[2],
            )
        )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--only-small", action="store_true")
    parser.add_argument("--only-large", action="store_true")
    parser.add_argument("--phases", nargs="+", default=["before", "local", "average"])
    parser.add_argument("--mesh", default="2x4", help="NODESxLOCAL devices, e.g. 1x1 on one GPU")
    parser.add_argument(
        "--specialize",
        default="true",
        choices=["true", "switch", "false"],
        help="data_parallel_step's specialize= (true: one program per phase)",
    )
    args = parser.parse_args(argv)
    nodes, local = (int(v) for v in args.mesh.split("x"))
    mesh = lsgd_jax.make_mesh(nodes, local, devices=jax.devices()[: nodes * local])
    specialize = {"true": True, "switch": "switch", "false": False}[args.specialize]
    rows = []
    if not args.only_large:
        rows += bench("small MLP", [64, 256, 256, 10], 32, args.reps, mesh, args.phases, specialize)
    if not args.only_small:
        rows += bench(
            "MLP 10.5M", [1024, 2048, 2048, 2048, 10], 16, args.reps, mesh, args.phases, specialize
        )
    kind = jax.devices()[0].device_kind
    print(
        f"Median step time over {args.reps} interleaved repetitions, {nodes * local} x {kind} "
        f"({nodes} nodes x {local}), jax {jax.__version__}.\n"
    )
    print(
        "| model | params | phase | lsgd_jax (ms) | hand-written (ms) "
        "| ratio (median) | ratio IQR |"
    )
    print("|---|---:|---|---:|---:|---:|---|")
    for name, n, phase, tl, th, r, q1, q3 in rows:
        print(f"| {name} | {n} | {phase} | {tl:.2f} | {th:.2f} | {r:.3f} | {q1:.3f}-{q3:.3f} |")
    return rows


if __name__ == "__main__":
    main()
