"""Does a model average overlap compute on GPUs? A check for a machine with 2+ GPUs.

Run: python benchmarks/gpu_overlap.py [--params 25_000_000] [--reps 20]

On CPU, XLA runs a program's collectives and its compute one after the other, and two
programs with collectives over the same devices, run from two threads, deadlock across
processes (benchmarks/RESULTS.md, part 6). On GPUs, XLA issues collectives
asynchronously and its latency-hiding scheduler may overlap them with independent
compute inside ONE program. This script measures, on every local GPU (one process):

- ``compute``: a chain of matmuls (the next steps' work);
- ``average``: an all-reduce (mean) of ``--params`` float32 values over all GPUs;
- ``one program``: both in one jitted program, with no data dependency between them;
- ``two threads``: the two programs dispatched from two Python threads at once;
- ``library``: ``data_parallel_step`` with ``PeriodicModelAverager(4, delay=2)`` and
  ``overlap=True`` (the mean in a background program) against ``overlap=False`` (the
  mean inside the step), per step;

and prints whether ``one program`` is closer to ``max(compute, average)`` (overlap) or to
their sum (none). XLA flags worth trying (set before JAX starts):
``XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true``.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lsgd_jax


def timed(f, *args, reps=10):
    jax.block_until_ready(f(*args))
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=25_000_000)
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--matmuls", type=int, default=40)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    n = jax.device_count()
    if n < 2:
        print(f"needs 2 or more devices, found {n} ({jax.devices()[0].device_kind})")
        return None
    mesh = lsgd_jax.make_mesh(1, n)
    D = P(("node", "local"))
    rep = NamedSharding(mesh, D)
    values = jax.device_put(jnp.ones((n, args.params)), rep)
    x = jax.device_put(jnp.ones((n * 256, args.width)), rep)
    w = jax.device_put(jnp.eye(args.width) * 0.5, NamedSharding(mesh, P()))

    def compute(x, w):
        for _ in range(args.matmuls):
            x = jnp.tanh(x @ w)
        return x

    def average(v):
        return jax.lax.pmean(v, ("node", "local"))

    smap = lambda f, i, o: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o))  # noqa: E731
    f_compute = smap(compute, (D, P()), D)
    f_average = smap(average, D, D)
    f_both = smap(lambda v, x, w: (average(v), compute(x, w)), (D, D, P()), (D, D))
    t_c = timed(f_compute, x, w, reps=args.reps)
    t_a = timed(f_average, values, reps=args.reps)
    t_both = timed(f_both, values, x, w, reps=args.reps)

    def threaded():
        box = {}
        th = threading.Thread(target=lambda: box.update(a=jax.block_until_ready(f_average(values))))
        th.start()
        jax.block_until_ready(f_compute(x, w))
        th.join()

    threaded()
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        threaded()
        times.append(time.perf_counter() - t0)
    t_threads = statistics.median(times)
    print(f"{n} x {jax.devices()[0].device_kind}, {args.params:,} values averaged")
    print(f"compute {t_c * 1e3:.1f} ms, average {t_a * 1e3:.1f} ms")
    print(f"sum {(t_c + t_a) * 1e3:.1f} ms, max {max(t_c, t_a) * 1e3:.1f} ms")
    for name, t in (("one program", t_both), ("two threads", t_threads)):
        hidden = (t_c + t_a - t) / min(t_c, t_a)
        print(f"{name}: {t * 1e3:.1f} ms: {100 * hidden:.0f}% of the shorter one hidden")
    library(mesh, args)
    return t_c, t_a, t_both, t_threads


def library(mesh, args):
    """The library's delayed average, in the step or in a background program."""
    n = mesh.devices.size
    rng = np.random.default_rng(0)
    dims = [args.width, args.width, args.width]
    params = [
        {"w": jnp.asarray(rng.standard_normal((a, b), np.float32) / np.sqrt(a))}
        for a, b in zip(dims[:-1], dims[1:])
    ]

    def loss_fn(p, b):
        h = b
        for layer in p:
            h = jnp.tanh(h @ layer["w"])
        return jnp.mean(h**2)

    batch = jax.device_put(
        jnp.ones((n * 64, args.width)), NamedSharding(mesh, P(("node", "local")))
    )
    for overlap in (False, True):
        tx = optax.chain(
            lsgd_jax.post_local_sgd(0, post_local_gradient_allreduce=False),
            optax.sgd(1e-3),
            lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(4, delay=2)),
        )
        step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, overlap=overlap)
        p = lsgd_jax.replicate(params, mesh)
        s = lsgd_jax.replicate(tx.init(params), mesh)
        for _ in range(8):
            p, s, loss = step(p, s, batch)
        jax.block_until_ready(loss)
        t0 = time.perf_counter()
        for _ in range(4 * args.reps):
            p, s, loss = step(p, s, batch)
        jax.block_until_ready(loss)
        per_step = (time.perf_counter() - t0) / (4 * args.reps)
        print(f"library, overlap={overlap}: {per_step * 1e3:.1f} ms per step")


if __name__ == "__main__":
    main()
