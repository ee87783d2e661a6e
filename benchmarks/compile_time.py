"""What a step costs to compile: time to the first step, in a fresh process each.

Run: python benchmarks/compile_time.py [--repeats 3] [--steps 24]

A small transformer language model (about 470k parameters: 2 layers, width 128, 4 heads,
vocabulary 512, context 64) on 8 simulated CPU devices (2 nodes x 4), trained with
``optax.chain(post_local_sgd(4), adamw, model_averaging(HierarchicalModelAverager({2:
"local", 8: global})))``: 2 hook phases x 3 averaging levels = 6 phases. Each
measurement runs in its own Python process (no compilation cache), and times

- the first step: tracing, compiling and running it (what a user waits for);
- the median time of the next steps in the first step's phase (global gradient mean,
  no average: the same math as the hand-written step); the run then goes on through
  every other phase (``--steps`` in all);
- the whole run: every step's time, compiles included wherever they happen (with one
  program per phase, each new phase compiles when it first occurs),

for ``data_parallel_step`` with ``specialize=True`` (one program per phase, compiled
when first needed; or all of them before the first step with ``step.compile``, counted
in its first step), ``"switch"`` (one program, every phase under one ``lax.switch``)
and ``False`` (the transforms' own conds), and with ``lowering="jit"`` (the loss under
plain ``jax.jit``, specialize=True), against a hand-written ``shard_map`` step of
the first phase (global gradient mean, no conditional): what one straight-line step
costs to compile. The switch is at step 10; levels average at steps 10, 12, 14, 16, ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

MODES = (
    "hand-written",
    "specialize=True",
    "specialize=True, compile ahead",
    "specialize='switch'",
    "specialize=False",
    "lowering='jit'",
)


def hand_written_step(loss_fn, inner, mesh, mean: bool = True):
    """A hand-written ``shard_map`` step over ``("node", "local")``: the gradients'
    mean over every replica (DDP; ``mean=False``: none, a local step), ``inner``'s
    update, the loss's mean. ``step(params, opt_state, batch) -> (params, opt_state,
    loss)`` on per-replica params and state (leading replica axis), donated."""
    import jax
    import optax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    data = P(("node", "local"))

    def body(params, opt_state, batch):
        params, opt_state = jax.tree.map(lambda x: x[0], (params, opt_state))
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        if mean:
            grads = lax.pmean(grads, ("node", "local"))
        updates, opt_state = inner.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        loss = lax.pmean(loss, ("node", "local"))
        return jax.tree.map(lambda x: x[None], (params, opt_state)) + (loss,)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(data,) * 3, out_specs=(data, data, P()))
    return jax.jit(mapped, donate_argnums=(0, 1))


def measure(mode: str, steps: int) -> dict:
    """Runs in a fresh process: first-step time and median step time of ``mode``."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import lsgd_jax

    vocab, width, heads, depth, context, per_replica = 512, 128, 4, 2, 64, 4
    mesh = lsgd_jax.make_mesh(2, 4)
    D = P(("node", "local"))

    def init(key):
        ks = iter(jax.random.split(key, 4 + 6 * depth))
        dense = lambda a, b: jax.random.normal(next(ks), (a, b)) / np.sqrt(a)  # noqa: E731
        layers = [
            {
                "qkv": dense(width, 3 * width),
                "out": dense(width, width),
                "up": dense(width, 4 * width),
                "down": dense(4 * width, width),
                "ln1": jnp.ones(width),
                "ln2": jnp.ones(width),
            }
            for _ in range(depth)
        ]
        return {
            "embed": dense(vocab, width),
            "pos": 0.02 * jax.random.normal(next(ks), (context, width)),
            "layers": layers,
            "head": dense(width, vocab),
        }

    def norm(x, scale):
        return scale * (x - x.mean(-1, keepdims=True)) * lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)

    def loss_fn(params, tokens):
        x = params["embed"][tokens[:, :-1]] + params["pos"][: context - 1]
        b, t, _ = x.shape
        mask = jnp.tril(jnp.ones((t, t), bool))
        for layer in params["layers"]:
            q, k, v = jnp.split(norm(x, layer["ln1"]) @ layer["qkv"], 3, axis=-1)
            q, k, v = (y.reshape(b, t, heads, -1) for y in (q, k, v))
            att = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(width // heads)
            att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
            x = x + jnp.einsum("bhts,bshd->bthd", att, v).reshape(b, t, width) @ layer["out"]
            x = x + jax.nn.gelu(norm(x, layer["ln2"]) @ layer["up"]) @ layer["down"]
        logits = x @ params["head"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    params0 = init(jax.random.key(0))
    n_params = sum(x.size for x in jax.tree.leaves(params0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (steps + 1, 8 * per_replica, context), dtype=np.int32)
    if steps < 17:
        raise ValueError("--steps must be at least 17: the switch is at step 10")
    batches = [jax.device_put(t, NamedSharding(mesh, D)) for t in tokens]
    start = 10
    tx = optax.chain(
        lsgd_jax.post_local_sgd(start, post_local_gradient_allreduce=False),
        optax.adamw(1e-3),
        lsgd_jax.model_averaging(
            lsgd_jax.HierarchicalModelAverager({2: "local", 8: ("node", "local")}, start)
        ),
    )
    if mode == "hand-written":
        inner = optax.adamw(1e-3)
        step = hand_written_step(loss_fn, inner, mesh)
        opt_state = lsgd_jax.replicate(inner.init(params0), mesh)
    else:
        specialize = {"specialize='switch'": "switch", "specialize=False": False}.get(mode, True)
        lowering = "jit" if mode == "lowering='jit'" else "shard_map"
        step = lsgd_jax.data_parallel_step(
            loss_fn, tx, mesh, specialize=specialize, lowering=lowering
        )
        opt_state = lsgd_jax.replicate(tx.init(params0), mesh)
    params = lsgd_jax.replicate(params0, mesh)
    t0 = time.perf_counter()
    if mode.endswith("compile ahead"):
        step.compile(params, opt_state, batches[0], num_steps=steps + 1)
    params, opt_state, loss = step(params, opt_state, batches[0])
    float(loss)
    first = time.perf_counter() - t0
    times, run = [], first
    for s in range(1, steps + 1):
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, batches[s])
        float(loss)
        run += time.perf_counter() - t0
        if s < start:  # global gradient mean, no average: the first step's phase
            times.append(time.perf_counter() - t0)
    return {
        "mode": mode,
        "params": int(n_params),
        "first_step_s": first,
        "step_ms": statistics.median(times) * 1e3,
        "run_s": run,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per mode")
    parser.add_argument("--steps", type=int, default=26)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args.worker, args.steps)))
        return None
    modes = [m for m in MODES if m in args.modes or m == "hand-written"]
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.repeats):  # interleaved, so drift hits every mode alike
        for mode in modes:
            out = subprocess.run(
                [sys.executable, __file__, "--worker", mode, "--steps", str(args.steps)],
                check=True,
                capture_output=True,
                text=True,
            )
            results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    hand = results["hand-written"]
    first_hand = statistics.median(r["first_step_s"] for r in hand)
    step_hand = statistics.median(r["step_ms"] for r in hand)
    print(
        f"Transformer LM, {hand[0]['params']:,} params, 8 x cpu (2 nodes x 4), 6 phases; "
        f"median of {args.repeats} fresh processes per row.\n"
    )
    print(
        "| step | time to first step (s) | vs hand-written | step time (ms) | "
        f"vs hand-written | whole run of {args.steps + 1} steps (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for mode in modes:
        first = statistics.median(r["first_step_s"] for r in results[mode])
        ms = statistics.median(r["step_ms"] for r in results[mode])
        run = statistics.median(r["run_s"] for r in results[mode])
        print(
            f"| {mode} | {first:.2f} | {first / first_hand:.2f} | {ms:.1f} | "
            f"{ms / step_hand:.2f} | {run:.1f} |"
        )
    return results


if __name__ == "__main__":
    main()
