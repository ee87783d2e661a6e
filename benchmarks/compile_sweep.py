"""Compile time and HLO size per program as the model grows, against a hand-written step.

Run: python benchmarks/compile_sweep.py [--leaves 8 64 256 1024] [--before REV]

A deep MLP of 32-wide layers (2 leaves a layer: weight and bias) on 8 simulated CPU
devices (2 nodes x 4), AdamW, ``post_local_sgd(8, post_local_gradient_allreduce=False)``
and ``PeriodicModelAverager(4, warmup_steps=8, communication=...)``: three programs over
24 steps (the DDP phase: global gradient mean; the average; the local phase). Each
program is compiled with ``step.compile`` (trace, lower and XLA compile, timed apart)
and its compiled HLO measured; ``switch`` is the one-program step
(``specialize="switch"``). Against two hand-written ``shard_map`` steps of the same
math: DDP (global gradient mean, AdamW) and local (AdamW, no collective but the loss's
mean). Communication: float32 (the default), int8 and 4-bit quantized two-level means,
with and without error feedback.

Each (revision, communication, leaves) runs in a fresh process (no cache). With
``--before REV`` the same sweep also runs on that git revision (a worktree of it, in a
temporary folder), interleaved with the working tree's, so that both are measured on
the same machine in the same run. Prints a table per leaf count and one JSON line per
measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_time import hand_written_step  # noqa: E402  (a script beside this one)

COMMS = ("float32", "int8", "int8 no EF", "4-bit", "4-bit no EF")


def measure(leaves: int, communication: str, hand: bool) -> list[dict]:
    """Runs in a fresh process: compile seconds and HLO size of each program."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import lsgd_jax

    width, layers = 32, leaves // 2
    mesh = lsgd_jax.make_mesh(2, 4)
    D = P(("node", "local"))
    params = {
        f"l{i:04d}": {"w": jnp.eye(width) * 0.9, "b": jnp.zeros(width)} for i in range(layers)
    }

    def loss_fn(p, x):
        for k in sorted(p):
            x = jnp.tanh(x @ p[k]["w"] + p[k]["b"])
        return jnp.mean(x**2)

    batch = jax.device_put(jnp.ones((64, width)), NamedSharding(mesh, D))
    p = lsgd_jax.replicate(params, mesh)
    rows = []

    def row(program, seconds, compiled):
        text = compiled.as_text()
        rows.append(
            {
                "leaves": leaves,
                "communication": communication,
                "program": program,
                "compile_s": seconds,
                "hlo_chars": len(text),
            }
        )

    if hand:
        inner = optax.adamw(1e-3)
        for name, mean in (("hand DDP", True), ("hand local", False)):
            step = hand_written_step(loss_fn, inner, mesh, mean)
            s = lsgd_jax.replicate(inner.init(params), mesh)
            t0 = time.perf_counter()
            compiled = step.lower(p, s, batch).compile()
            row(name, time.perf_counter() - t0, compiled)
        return rows
    strategy = None
    if communication != "float32":
        bits = 8 if communication.startswith("int8") else 4
        strategy = lsgd_jax.comm.quantized(
            bits, two_level=True, error_feedback="no EF" not in communication
        )
    tx = optax.chain(
        lsgd_jax.post_local_sgd(8, post_local_gradient_allreduce=False),
        optax.adamw(1e-3),
        lsgd_jax.model_averaging(
            lsgd_jax.PeriodicModelAverager(4, warmup_steps=8, communication=strategy)
        ),
    )
    s = lsgd_jax.replicate(tx.init(params), mesh)
    names = {2: "DDP phase", 1: "average", 0: "local phase", "switch": "switch"}
    for specialize in (True, "switch"):
        step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, specialize=specialize)
        seconds = step.compile(p, s, batch, num_steps=24)
        for mode, compiled in step.programs_of(p, s, batch, num_steps=24):
            row(names.get(mode, str(mode)), seconds[mode], compiled)
    return rows


@contextlib.contextmanager
def worktree(rev: str):
    """A checkout of ``rev`` in a temporary folder (removed afterwards)."""
    folder = tempfile.mkdtemp(prefix="lsgd_jax-before-")
    subprocess.run(
        ["git", "worktree", "add", "--detach", folder, rev], check=True, capture_output=True
    )
    try:
        yield folder
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", folder], check=False)


def run_worker(root: str, leaves: int, communication: str, hand: bool) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=root)
    env = {k: v for k, v in env.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    cmd = [sys.executable, __file__, "--worker", str(leaves), communication]
    out = subprocess.run(
        cmd + (["--hand"] if hand else []),
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[dict], leaves: int, versions: list[str]) -> None:
    hand = {
        r["program"]: r for r in rows if r["leaves"] == leaves and r["program"].startswith("hand")
    }
    print(
        f"\n{leaves} leaves: hand-written DDP {hand['hand DDP']['compile_s']:.2f} s, "
        f"{hand['hand DDP']['hlo_chars'] / 1e6:.2f} M chars; local "
        f"{hand['hand local']['compile_s']:.2f} s, {hand['hand local']['hlo_chars'] / 1e6:.2f} M"
    )
    print("| version | communication | program | compile (s) | vs hand | HLO (M chars) | vs hand |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        if r["leaves"] != leaves or r["program"].startswith("hand"):
            continue
        ref = hand["hand local" if r["program"] == "local phase" else "hand DDP"]
        print(
            f"| {r['version']} | {r['communication']} | {r['program']} | {r['compile_s']:.2f} | "
            f"{r['compile_s'] / ref['compile_s']:.2f} | {r['hlo_chars'] / 1e6:.2f} | "
            f"{r['hlo_chars'] / ref['hlo_chars']:.2f} |"
        )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--leaves", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--communications", nargs="+", default=list(COMMS), choices=COMMS)
    parser.add_argument("--before", default=None, help="a git revision to measure too")
    parser.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--hand", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(int(args.worker[0]), args.worker[1], args.hand)))
        return None
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with contextlib.ExitStack() as stack:
        roots = {"now": here}
        if args.before:
            roots = {"before": stack.enter_context(worktree(args.before)), **roots}
        rows: list[dict] = []
        for leaves in args.leaves:
            for r in run_worker(here, leaves, "float32", hand=True):
                rows.append(dict(r, version="-"))
                print(json.dumps(rows[-1]), flush=True)
            for communication in args.communications:
                for version, root in roots.items():  # interleaved: drift hits both alike
                    for r in run_worker(root, leaves, communication, hand=False):
                        rows.append(dict(r, version=version))
                        print(json.dumps(rows[-1]), flush=True)
            table(rows, leaves, list(roots))
    return rows


if __name__ == "__main__":
    main()
