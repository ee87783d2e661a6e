"""Memory per device when a replica spans devices (FSDP inside a replica).

Run: python benchmarks/memory.py [--width 128] [--layers 4] [--time-steps 40]

On 8 simulated CPU devices: two replicas, each over 1, 2 or 4 devices of an ``"fsdp"``
axis (meshes (2, 1, k) of ``("node", "local", "fsdp")``), and as HSDP one replica per
node of 4 devices (``axes=("node",)``, ``shard_over="local"``). The model is a
transformer-shaped parameter tree (embedding, per layer attention and MLP matrices,
norms, biases) and the optimizer is AdamW with DiLoCo-style averages: an outer Nesterov
step, a delay of 1 and int8 means with error feedback, so that the averager holds every
buffer it can (anchor, outer momentum, residual, delayed start and mean). Bytes are read
from the arrays' shards on each device after three training steps (a delayed average
then in flight): exact, not timed, so the table is the same on any machine.

``--time-steps N`` also times N steps of the 4-device replicas with and without
``offload_state=True`` (the averages' steps and the others apart, medians, after two
warm-up steps): what keeping the averager's buffers in host memory costs an average.
On CPU host and device memory are the same RAM, so this times the copies' bookkeeping,
not a PCIe transfer; on an accelerator it is the number that matters.
"""

from __future__ import annotations

import argparse

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402

import lsgd_jax  # noqa: E402
from lsgd_jax import comm  # noqa: E402


def params_of(width: int, layers: int, vocab: int = 256) -> dict:
    """A transformer-shaped tree of float32 params (values irrelevant here)."""
    tree: dict = {"embed": jnp.zeros((vocab, width)), "norm": jnp.ones(width)}
    for i in range(layers):
        tree[f"layer{i}"] = {
            "qkv": jnp.zeros((width, 3 * width)),
            "out": jnp.zeros((width, width)),
            "up": jnp.zeros((width, 4 * width)),
            "down": jnp.zeros((4 * width, width)),
            "norm1": jnp.ones(width),
            "norm2": jnp.ones(width),
            "bias": jnp.zeros(4 * width),
        }
    return tree


def loss_fn(params, batch):
    h = params["embed"][batch["x"]]
    for name in sorted(k for k in params if k.startswith("layer")):
        p = params[name]
        h = h + jnp.tanh(h @ p["up"] + p["bias"]) @ p["down"] * p["norm1"]
    return jnp.mean((h * params["norm"]) ** 2)


def chain(hsdp: bool = False, offload: bool = False) -> optax.GradientTransformation:
    """AdamW and every averager buffer; with ``hsdp`` a replica is a whole node."""
    averager = lsgd_jax.PeriodicModelAverager(
        2,
        warmup_steps=1,
        outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True),
        delay=1,
        communication=comm.quantized(8, error_feedback=True),
        process_group="node" if hsdp else None,
        offload_state=offload,
    )
    return optax.chain(
        lsgd_jax.post_local_sgd(
            1,
            process_group="node" if hsdp else None,
            post_local_gradient_allreduce=not hsdp,
        ),
        optax.adamw(1e-3),
        lsgd_jax.model_averaging(averager),
    )


def per_device(tree) -> float:
    """The largest number of bytes any one device holds of ``tree`` in device memory
    (host-memory buffers, ``offload_state=True``, not counted)."""
    out: dict = {}
    for leaf in jax.tree.leaves(tree):
        if leaf.sharding.memory_kind == "pinned_host":
            continue
        for shard in leaf.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return max(out.values())


BATCH = {"x": np.arange(64, dtype=np.int32).reshape(16, 4) % 256}


def training(mesh, axes, fsdp, params0, offload=False) -> tuple:
    """``(step, params, opt_state)`` of :func:`chain` laid out over ``mesh``."""
    tx = chain(hsdp=axes == ("node",), offload=offload)
    params = lsgd_jax.replicate(params0, mesh, axes, shard_over=fsdp)
    opt_state = lsgd_jax.replicate(tx.init(params0), mesh, axes, shard_over=fsdp)
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, axes=axes, fsdp_axes=fsdp)
    return step, params, opt_state


def measure(mesh, axes, fsdp, params0, offload=False) -> tuple[float, float, float]:
    """Per-device bytes of params, Adam's state and the averager's, after three steps."""
    step, params, opt_state = training(mesh, axes, fsdp, params0, offload)
    batch = BATCH
    for _ in range(3):
        params, opt_state, _ = step(params, opt_state, batch)
    (state,) = lsgd_jax.averager_states(opt_state)
    return per_device(params), per_device(opt_state) - per_device(state), per_device(state)


def time_steps(mesh, params0, offload: bool, steps: int) -> tuple[float, float]:
    """Median seconds of the steps that average (every second one) and of the others."""
    import time

    step, params, opt_state = training(mesh, None, "fsdp", params0, offload)
    batch = BATCH
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(steps + 2):
        (before,) = lsgd_jax.averager_states(opt_state)
        count = int(np.ravel(before.outer_count)[0])  # read before the step donates it
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, batch)
        jax.block_until_ready((params, opt_state, loss))
        (after,) = lsgd_jax.averager_states(opt_state)
        averaged = int(np.ravel(after.outer_count)[0]) != count
        if i >= 2:  # the first steps compile
            times[averaged].append(time.perf_counter() - t0)
    return float(np.median(times[True])), float(np.median(times[False]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--time-steps", type=int, default=0, help="also time offload (N steps)")
    args = parser.parse_args()
    params0 = params_of(args.width, args.layers)
    count = sum(x.size for x in jax.tree.leaves(params0))
    print(f"{count:,} parameters; bytes per device (MiB), after three steps\n")
    print("| layout | devices per replica | params | AdamW state | averager state | total | vs 1 |")
    print("|---|---|---|---|---|---|---|")
    base = None
    rows = []
    for k in (1, 2, 4):
        devices = np.array(jax.devices()[: 2 * k]).reshape(2, 1, k)
        mesh = Mesh(devices, ("node", "local", "fsdp"), axis_types=(AxisType.Auto,) * 3)
        rows.append((f"(2, 1, {k}), fsdp_axes='fsdp'", k, measure(mesh, None, "fsdp", params0)))
    rows.append(
        ("(2, 1, 4), and offload_state=True", 4, measure(mesh, None, "fsdp", params0, True))
    )
    hsdp = lsgd_jax.make_mesh(2, 4)
    rows.append(("HSDP 2 x 4, axes=('node',)", 4, measure(hsdp, ("node",), "local", params0)))
    for name, k, (p, o, a) in rows:
        total = p + o + a
        base = base or total
        mib = [f"{x / 2**20:.3f}" for x in (p, o, a, total)]
        print(f"| {name} | {k} | " + " | ".join(mib) + f" | {total / base:.3f} |")
    if args.time_steps:
        print("\n| (2, 1, 4), fsdp_axes='fsdp' | averaging step (ms) | other step (ms) |")
        print("|---|---|---|")
        for offload in (False, True):
            avg, other = time_steps(mesh, params0, offload, args.time_steps)
            name = "offload_state=True" if offload else "on the device"
            print(f"| {name} | {1000 * avg:.1f} | {1000 * other:.1f} |")


if __name__ == "__main__":
    main()
