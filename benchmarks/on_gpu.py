"""Runs parts 1 and 2 of the benchmarks on a GPU machine and appends them to RESULTS.md.

Run (on a machine with NVIDIA GPUs and a CUDA build of jax): python benchmarks/on_gpu.py

- Part 1, what a step communicates: benchmarks/communication.py --platform cuda (the
  step lowered for CUDA; needs no GPU, so it runs on the 8 simulated CPU devices).
- Part 2, what the library costs: benchmarks/overhead.py on the GPUs, on a (2 nodes x
  G/2) mesh when there are at least 2 GPUs, else on a (1 x 1) mesh: with one GPU there
  is nothing to communicate, but the cost of the library's branching (one lax.switch
  over the phases of the step) against a hand-written step is still measured.

- Part 3, the language model (examples/lm.py, issue 20) on the GPUs: DDP, post-local
  SGD (H=8, H=32), DiLoCo with 4-bit two-level averages, and delayed averages, each
  with its median step time, peak device memory and validation loss (200 steps, the
  default model), on the same mesh as part 2.

The tables are appended to benchmarks/RESULTS.md under a heading that names the device
and the date, with the commands that produced them.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def gpu_count() -> tuple[int, str]:
    code = (
        "import jax; d = [x for x in jax.devices() if x.platform == 'gpu'];"
        "print(len(d), d[0].device_kind if d else '')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        env={**os.environ, "JAX_PLATFORMS": ""},
    )  # fmt: skip
    if out.returncode:
        return 0, out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""
    n, _, kind = out.stdout.strip().partition(" ")
    return int(n), kind


def run(cmd: list[str], env: dict[str, str]) -> str:
    print("$", " ".join(cmd), flush=True)
    out = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=3600, cwd=HERE.parent
    )
    if out.returncode:
        raise SystemExit(f"{cmd} failed:\n{out.stderr[-3000:]}")
    return "\n".join(line for line in out.stdout.splitlines() if not line.startswith("WARNING"))


LM_METHODS = "ddp,local8,local32,diloco32:bits4,local8:delay1"


def lm_table(output: str) -> str:
    """examples/lm.py's JSON lines as a table: step time, memory, loss, bytes."""
    rows = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    head = (
        "| run | ms per step | peak device MiB | val loss | cross-node MB |\n|---|---|---|---|---|"
    )
    lines = [
        f"| {r['method']} | {1e3 * r['compute_s_per_step']:.1f} | "
        f"{(r['peak_device_bytes'] or 0) / 2**20:.0f} | {r['val_loss']:.4f} | "
        f"{r['cross_node_bytes'] / 1e6:.1f} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def main() -> None:
    n, kind = gpu_count()
    if n == 0:
        raise SystemExit(
            "No GPU visible to JAX: this script needs NVIDIA GPUs and a CUDA build of jax "
            f"(pip install 'jax[cuda13]'). {kind}"
        )
    mesh = f"2x{n // 2}" if n >= 2 else "1x1"
    env = {**os.environ, "LSGD_BENCH_PLATFORM": "gpu"}
    comm_cmd = [sys.executable, "benchmarks/communication.py", "--platform", "cuda"]
    over_cmd = [sys.executable, "benchmarks/overhead.py", "--mesh", mesh, "--reps", "50"]
    comm = run(comm_cmd, {**os.environ, "LSGD_BENCH_PLATFORM": "cpu"})
    over = run(over_cmd, env)
    lm_cmd = [sys.executable, "examples/lm.py", "--platform", "gpu", "--mesh", mesh]
    lm_cmd += ["--compare", LM_METHODS, "--steps", "200", "--start", "50", "--no-progress"]
    lm = lm_table(run(lm_cmd, {**os.environ, "JAX_PLATFORMS": ""}))
    date = datetime.date.today().isoformat()
    text = (
        f"\n\n## On {n} x {kind} ({date})\n\n"
        f"`{' '.join(comm_cmd[1:])}`\n\n{comm}\n\n"
        f"`LSGD_BENCH_PLATFORM=gpu {' '.join(over_cmd[1:])}`\n\n{over}\n\n"
        f"`{' '.join(lm_cmd[1:])}`\n\n{lm}\n"
    )
    with open(HERE / "RESULTS.md", "a") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
