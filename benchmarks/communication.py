"""What each step communicates, read off the compiled programs, per 100 steps.

Run: python benchmarks/communication.py [--params N] [--steps 100]

For every configuration it compiles the gradient hook and the model averaging on their
own (8 simulated CPU devices, a (2 nodes x 4) mesh, or (2 pods x 2 nodes x 2) for the
3-level hierarchy), reads every collective with lsgd_jax.communication_report, and adds
up, step by step over `--steps` steps after the switch, the bytes of the branches the
schedule takes. It then checks the totals against the arithmetic (parameter bytes x the
number of global steps / averages) and prints a markdown table. Bytes are the data each
device puts into its all-reduces (the logical volume); a ring all-reduce moves about
2 (n - 1) / n times that over the wire.
"""

from __future__ import annotations

import argparse

import jax

jax.config.update("jax_platforms", "cpu")  # compiled (or lowered) for 8 simulated devices
jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import lsgd_jax  # noqa: E402


def compiled_report(tx, mesh, params, platform=None):
    """The collectives of one optimizer update, compiled for the mesh (or lowered for
    ``platform``, e.g. "cuda", with jax.export: no such device needed)."""
    loss = lambda p, b: sum(jnp.vdot(x, x) for x in jax.tree.leaves(p)) * jnp.mean(b)  # noqa: E731
    step = lsgd_jax.data_parallel_step(loss, tx, mesh, donate=False)
    n = mesh.devices.size
    args = (
        lsgd_jax.replicate(params, mesh),
        lsgd_jax.replicate(tx.init(params), mesh),
        jnp.ones((n,)),
    )
    report = step.communication_report(*args, platform=platform)
    return [c for c in report if c.bytes > 4]  # drop the 4-byte mean of the loss


def by_axes(report):
    """{axes: bytes} of a component's conditional collectives (one per branch)."""
    out = {}
    for c in report:
        assert c.conditional, f"unconditional collective: {c}"
        out[c.axes] = out.get(c.axes, 0) + c.bytes
    return out


def crosses_nodes(axes):
    return any(a in ("node", "pod") for a in axes)


def tally(hook, averager, start, steps, hook_cfg):
    """Bytes inside / across nodes over `steps` steps after the switch."""
    inside = across = 0
    hook_bytes, avg_bytes = by_axes(hook), by_axes(averager) if averager else {}
    global_axes = max(hook_bytes, key=len) if hook_bytes else None
    for s in range(start, start + steps):
        # the hook: global before the switch, then the subgroup (or nothing)
        if s < hook_cfg["start"]:
            axes = global_axes
        elif hook_cfg["post_local_gradient_allreduce"]:
            axes = hook_cfg["subgroup"]
        else:
            axes = None
        if axes is not None:
            b = hook_bytes[axes]
            across += b if crosses_nodes(axes) else 0
            inside += 0 if crosses_nodes(axes) else b
        if averager is not None:
            level = hook_cfg["averager"].level(s)
            if level:
                axes = hook_cfg["groups"][level - 1]
                b = avg_bytes[axes]
                across += b if crosses_nodes(axes) else 0
                inside += 0 if crosses_nodes(axes) else b
    return inside, across


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=1 << 20, help="float32 parameters")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--platform", default=None, help="lower for cuda/tpu instead of compiling")
    args = parser.parse_args(argv)
    P = args.params * 4
    params = {"w": jnp.zeros((args.params - 1000,)), "b": jnp.zeros((1000,))}
    mesh = lsgd_jax.make_mesh(2, 4)
    mesh3 = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("pod", "node", "local"))
    start = 1000  # the switch; we count the `steps` steps from it
    rows = []

    def run(name, msh, hook_kwargs, averager, groups, expect):
        hook_tx = lsgd_jax.post_local_sgd(start, **hook_kwargs)
        hook = compiled_report(hook_tx, msh, params, args.platform)
        avg = (
            compiled_report(lsgd_jax.model_averaging(averager), msh, params, args.platform)
            if averager
            else None
        )
        subgroup = hook_kwargs.get("subgroup") or "local"
        cfg = {
            "start": start if name != "DDP" else 10**9,
            "post_local_gradient_allreduce": hook_kwargs.get("post_local_gradient_allreduce", True),
            "subgroup": tuple(subgroup) if isinstance(subgroup, tuple) else (subgroup,),
            "averager": averager,
            "groups": groups,
        }
        inside, across = tally(hook, avg, start, args.steps, cfg)
        ok = (inside, across) == expect
        rows.append((name, inside, across, expect, ok))

    S, G = args.steps, ("node", "local")
    run("DDP", mesh, {}, None, None, (0, S * P))
    for post in (True, False):
        for h in (2, 4, 8, 16, 32):
            averager = lsgd_jax.PeriodicModelAverager(h, warmup_steps=start)
            name = f"post-local SGD, H={h}" + ("" if post else ", no grad all-reduce")
            n_avg = len(range(0, S, h))
            run(
                name,
                mesh,
                {"post_local_gradient_allreduce": post},
                averager,
                [G],
                ((S * P) if post else 0, n_avg * P),
            )
    groups3 = [("local",), ("node", "local"), ("pod", "node", "local")]
    hier = lsgd_jax.HierarchicalModelAverager(
        {2: "local", 4: ("node", "local"), 8: ("pod", "node", "local")}, warmup_steps=start
    )
    levels = [hier.level(s) for s in range(start, start + S)]
    expect3 = (levels.count(1) * P, (levels.count(2) + levels.count(3)) * P)
    run(
        "3-level hierarchy 2/4/8 (pod x node x local), no grad all-reduce",
        mesh3,
        {"post_local_gradient_allreduce": False, "process_group": ("pod", "node", "local")},
        hier,
        groups3,
        expect3,
    )

    how = f"lowered for {args.platform}" if args.platform else "compiled for CPU"
    mb = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
    print(
        f"Bytes per device over {S} steps after the switch; {args.params:,} float32 "
        f"parameters = {mb(P)} MiB; 8 devices, {how}.\n"
    )
    print("| run | inside nodes (MiB) | across nodes (MiB) | arithmetic (inside, across) | equal |")
    print("|---|---:|---:|---|---|")
    for name, inside, across, expect, ok in rows:
        print(
            f"| {name} | {mb(inside)} | {mb(across)} | {mb(expect[0])}, {mb(expect[1])} | "
            f"{'yes' if ok else 'NO'} |"
        )
    assert all(r[-1] for r in rows), "a measured figure differs from the arithmetic"
    return rows


if __name__ == "__main__":
    main()
