"""Demo: DDP against post-local SGD on 8 simulated CPU devices (2 nodes x 4).

Run ``python -m lsgd_jax.demo``. It trains the same small MLP classifier with the same
data three times: synchronous data parallel (every step's gradients averaged over all
8 replicas), and post-local SGD switching after 50 steps with model averaging every 4
and every 16 steps. It prints the final loss and accuracy of the averaged model next to
the number of global (cross-node) all-reduces each run made and the bytes they carried,
and the seconds spent compiling (every phase's program, before the clock starts) apart
from the seconds the steps took. On 8 simulated devices sharing this machine's cores
the steps take about as long either way: what post-local SGD saves is the cross-node
traffic, which a slow link turns into time (``benchmarks/slow_link.py``).
"""

from __future__ import annotations

import argparse
import os
import time


def _setup_devices(n: int) -> None:
    import jax

    if jax.config.jax_platforms in (None, "", "cpu"):  # type: ignore[attr-defined]  # not in jax's stubs
        os.environ.setdefault("PJRT_NPROC", str(2 * n))  # 2 threads a device (see make_mesh)
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--start", type=int, default=50, help="start_localSGD_iter")
    parser.add_argument("--periods", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    _setup_devices(8)

    import lsgd_jax

    lsgd_jax.use_compilation_cache()  # a rerun loads its programs instead of compiling
    mesh = lsgd_jax.make_mesh(num_nodes=2, devices_per_node=4)
    data = _teacher_data(args.steps * _PER_REPLICA * mesh.devices.size + 4096, args.seed)
    rows = [_run("DDP (global every step)", None, 0, mesh, data, args)]
    for h in args.periods:
        rows.append(_run(f"post-local SGD, H={h}", args.start, h, mesh, data, args))
    print(f"{args.steps} steps, 2 nodes x 4 devices, switch at step {args.start}")
    _print_table(rows)
    return rows


_PER_REPLICA = 32  # examples per replica and step


def _model():
    """``(init_params(key, din), logits(params, x), loss_fn(params, batch))``: an MLP."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    def init_params(key, din, hidden=64, classes=10):
        k1, k2 = jax.random.split(key)
        return {
            "w1": jax.random.normal(k1, (din, hidden)) / np.sqrt(din),
            "b1": jnp.zeros(hidden),
            "w2": jax.random.normal(k2, (hidden, classes)) / np.sqrt(hidden),
            "b2": jnp.zeros(classes),
        }

    def logits(p, x):
        return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

    def loss_fn(p, batch):
        return optax.softmax_cross_entropy_with_integer_labels(
            logits(p, batch["x"]), batch["y"]
        ).mean()

    return init_params, logits, loss_fn


def _run(name: str, start: int | None, period: int, mesh, data, args) -> dict:
    """One training run; its row of the table."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import lsgd_jax

    x_all, y_all = data
    init_params, logits, loss_fn = _model()
    averager, tx = _optimizer(start, period)
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh)
    p0 = init_params(jax.random.key(args.seed), x_all.shape[1])
    params, opt_state = lsgd_jax.replicate(p0, mesh), lsgd_jax.replicate(tx.init(p0), mesh)
    b = _PER_REPLICA * mesh.devices.size
    batches = (
        {"x": x_all[s * b : (s + 1) * b], "y": y_all[s * b : (s + 1) * b]}
        for s in range(args.steps)
    )
    first = {"x": x_all[:b], "y": y_all[:b]}
    # every phase's program before the clock starts, so steps are timed alone
    compile_s = sum(step.compile(params, opt_state, first, num_steps=args.steps).values())
    ledger = lsgd_jax.communication_ledger(step, params, opt_state, first, num_steps=args.steps)
    t0 = time.perf_counter()
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, batch)
    loss = float(loss)
    seconds = time.perf_counter() - t0
    # PyTorch's iter counts the global gradient steps
    grad_global = args.steps if start is None else int(np.asarray(opt_state[0].iter)[0])
    averages = int(np.count_nonzero(averager.schedule(args.steps))) if averager else 0
    model = lsgd_jax.consensus(params)
    x_test, y_test = x_all[-4096:], y_all[-4096:]
    return {
        "run": name,
        "train loss": loss,
        "test acc": float(jnp.mean(jnp.argmax(logits(model, x_test), 1) == y_test)),
        "global all-reduces": grad_global + averages,
        "cross-node MB/device": ledger.total() / 1e6,
        "node-local all-reduces": args.steps - grad_global,
        "compile s": compile_s,
        "steps s": seconds,
    }


def _optimizer(start: int | None, period: int):
    """``(averager or None, tx)``: DDP (start None: a chain without the hook averages
    every step's gradients) or post-local SGD switching at ``start``."""
    import optax

    import lsgd_jax

    if start is None:
        return None, optax.sgd(0.2, momentum=0.9)
    averager = lsgd_jax.PeriodicModelAverager(period, warmup_steps=start)
    tx = optax.chain(
        lsgd_jax.post_local_sgd(start),
        optax.sgd(0.2, momentum=0.9),
        lsgd_jax.model_averaging(averager),
    )
    return averager, tx


def _teacher_data(n: int, seed: int, din: int = 32, classes: int = 10):
    """``n`` inputs and the labels a noisy linear teacher gives them."""
    import numpy as np

    rng = np.random.default_rng(seed)
    teacher = rng.standard_normal((din, classes)).astype(np.float32)
    x = rng.standard_normal((n, din)).astype(np.float32)
    y = np.argmax(x @ teacher + 0.5 * rng.standard_normal((n, classes)), 1)
    return x, y


def _print_table(rows: list[dict]) -> None:
    cols = list(rows[0])
    fmt = {
        "train loss": "{:.4f}",
        "test acc": "{:.3f}",
        "cross-node MB/device": "{:.2f}",
        "compile s": "{:.1f}",
        "steps s": "{:.1f}",
    }
    table = [cols] + [[fmt.get(c, "{}").format(r[c]) for c in cols] for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(cols))]
    for i, r in enumerate(table):
        cells = (v.rjust(w) if i and j else v.ljust(w) for j, (v, w) in enumerate(zip(r, widths)))
        print("  ".join(cells))
        if i == 0:
            print("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    main()
