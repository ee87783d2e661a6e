"""Test accuracy against cross-node bytes: large-batch DDP, post-local SGD, and the options
beyond PyTorch, on 8 simulated CPU devices arranged as 2 nodes x 4.

Run: python benchmarks/accuracy.py --plot benchmarks/accuracy.png --json results.json
(14 to 18 minutes on 2 shared CPU cores: 84 runs of 400 steps; ``--quick``, for CI: one
task, one seed, 4 configurations of 32 steps, about 20 s). ``--from-json results.json
--plot out.png`` prints and plots saved rows without training.

It trains the Flax NNX CNN of ``examples/digits_cnn.py`` (its model, data pipeline,
training loop and byte accounting are imported from there, not copied; width 8, 3,834
parameters, to fit the budget) on two tasks:

- ``digits``: scikit-learn's digits as in the example (1437 training, 360 test images).
- ``noisy-digits``, the harder task: the same images, half for training (898) and half
  for testing (899); 20% of the training labels replaced by another class at random
  (test labels clean), and Gaussian pixel noise (sigma 0.5 on pixels in [0, 1]) added
  once to every image, training and test. Why this one: it needs no download, it keeps
  the model and data pipeline of the example (8x8 images, 10 classes), and it is hard
  in the way Lin et al.'s claim is about, generalization: the network fits the noisy
  training set (noisy labels included) while the test accuracy, after peaking early,
  falls, so the final accuracy measures how much noise each scheme memorizes, and the
  noisy inputs keep it far from 100%. On plain digits every reasonable scheme lands
  within a point of the others; here they spread out. (A variant with 4 freshly noised
  and shifted copies of each training image, which the network cannot memorize, put
  DDP and H = 4 or 32 within 0.5 points of each other at about 60%: no gap to see.)

Every run: global batch 128 (16 per device), SGD with momentum 0.9, learning rate
``--lr`` divided by 10 at 50% and again at 75% of the steps (Lin et al.'s recipe), the
same data order and initialization for every configuration of a seed. Configurations:

- DDP: gradients all-reduced over all 8 replicas on every step
  (``post_local_sgd(start_localSGD_iter=steps)``).
- post-local SGD, H in ``--periods``, switching ``early`` (``--early``, default 1/8 of
  the steps) and, for ``--middle-periods``, in the ``middle`` (at the first learning-rate
  decay, where Lin et al. switch): global gradient all-reduce until the switch, then
  node-local gradient all-reduce and a global model average every H steps.
- beyond PyTorch, all switching early and comparable to H=16: an outer optimizer
  (DiLoCo: ``outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True)``, each node
  one DiLoCo worker, so the node-local gradient all-reduce stays), once anchored at the
  initial params (``outer_skip_first=False``: its first step, at the switch, acts on the
  whole warm-up's progress as if it were one round's) and once with the library's
  default (the first global average only sets the anchor); momentum averaging
  (``post_local_sgd_optimizer(..., average_opt_state=<every array leaf>)``); bf16
  communication with delta averaging; a period schedule (32 until the first decay,
  then 8: AdaComm's long-then-short); streaming averaging with 4 fragments. On request
  (``--beyond two_level int8 int4 delay int4_delay``): the two-level mean, int8 and 4-bit
  averages (two-level, error feedback), a delay of 8 steps, and 4-bit with that delay.

Accuracy is the test accuracy of the consensus model (the mean of the 8 replicas) at
the end, mean +- sample std over ``--seeds``. Bytes are what each device puts into
cross-node collectives over the whole run, charged step by step for the phase the step
takes (``examples/digits_cnn.py``'s ``schedule_of``), from the step compiled for CPU
(``lsgd_jax.communication_report``); the 8 bytes of the reported loss and correct
count ride along every step. For bf16 communication the figure comes from the step
lowered for CUDA (``communication_report(..., platform="cuda")``), because XLA on CPU
upcasts bf16 collectives to f32; the table notes it. The final consensus (one more
global average, for evaluation) is not counted. ``wire ratio`` compares the estimated
link traffic (``Collective.wire_bytes``: a ring all-reduce sends 2 (g - 1) / g times its
input, an all-to-all (g - 1) / g), which differs from the byte ratio only for bf16's
all-to-all + all-gather. ``peak`` is the largest per-step cross-node volume after the
switch (what ``fragments`` lowers).
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import digits_cnn  # noqa: E402  (starts no JAX backend)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import lsgd_jax  # noqa: E402

QUICK = ["--steps", "32", "--early", "8", "--seeds", "0", "--tasks", "digits"]
QUICK += ["--periods", "4", "16", "--middle-periods", "--beyond", "bf16", "--eval-every", "32"]
BEYOND = ("outer", "outer_anchored", "opt_state", "bf16", "schedule", "fragments")
# the ways of sending an average (issue: hide and shrink the sync), run with --beyond
COMM = ("two_level", "int8", "int4", "delay", "int4_delay")
TASKS = ("digits", "noisy-digits")


# --- tasks ----------------------------------------------------------------------------


def noisy_digits(
    seed: int = 0,
    train_fraction: float = 0.5,
    label_noise: float = 0.2,
    pixel_noise: float = 0.5,
) -> digits_cnn.Digits:
    """The harder task: few noisy-labelled training images, noisy pixels (see the top)."""
    full = digits_cnn.load_digits(seed)
    x = np.concatenate([full.x_train, full.x_test])
    y = np.concatenate([full.y_train, full.y_test])
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, train_size=train_fraction, random_state=seed, stratify=y
    )
    rng = np.random.default_rng(seed)
    flip = rng.random(len(y_tr)) < label_noise
    y_tr = np.where(flip, (y_tr + rng.integers(1, 10, len(y_tr))) % 10, y_tr).astype(np.int32)
    x_tr = (x_tr + pixel_noise * rng.standard_normal(x_tr.shape)).astype(np.float32)
    x_te = (x_te + pixel_noise * rng.standard_normal(x_te.shape)).astype(np.float32)
    return digits_cnn.Digits(x_tr, y_tr, x_te, y_te)


def load_task(name: str) -> digits_cnn.Digits:
    return digits_cnn.load_digits(0) if name == "digits" else noisy_digits(0)


# --- configurations -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sizes:
    steps: int
    early: int
    lr: float

    @property
    def middle(self) -> int:
        return self.steps // 2  # the first learning-rate decay

    def learning_rate(self) -> optax.Schedule:
        decays = {self.steps // 2: 0.1, (3 * self.steps) // 4: 0.1}
        return optax.piecewise_constant_schedule(self.lr, decays)


@dataclasses.dataclass(frozen=True)
class Config:
    """One row: ``make(sizes)`` builds its optimizer.

    Attributes:
      name: the row's label.
      switch: "early", "middle", or None (DDP).
      period: H, for the periodic rows (the ratio the arithmetic predicts).
      lowered: take the bytes from the step lowered for CUDA (bf16 on the wire).
    """

    name: str
    make: Callable[[Sizes], Any]
    switch: str | None = None
    period: int | None = None
    lowered: bool = False
    option: str | None = None

    def start(self, sizes: Sizes) -> int | None:
        return {"early": sizes.early, "middle": sizes.middle}.get(self.switch)


def _sgd(sizes: Sizes) -> optax.GradientTransformation:
    return optax.sgd(sizes.learning_rate(), momentum=0.9)


def _every_array(inner_state: Any) -> Any:
    return jax.tree.map(lambda x: jnp.ndim(x) > 0, inner_state)  # momentum, not counters


def make_configs(periods: list[int], middle_periods: list[int], beyond: list[str]) -> list:
    def nesterov():
        return optax.sgd(0.7, momentum=0.9, nesterov=True)  # DiLoCo's outer optimizer

    def ddp(sz):
        return optax.chain(lsgd_jax.post_local_sgd(sz.steps), _sgd(sz))

    def periodic(h, switch, **options):
        def make(sz):
            start = sz.early if switch == "early" else sz.middle
            averager = lsgd_jax.PeriodicModelAverager(h, warmup_steps=start, **options)
            return optax.chain(
                lsgd_jax.post_local_sgd(start), _sgd(sz), lsgd_jax.model_averaging(averager)
            )

        return make

    def opt_state(sz):
        averager = lsgd_jax.PeriodicModelAverager(16, warmup_steps=sz.early)
        return optax.chain(
            lsgd_jax.post_local_sgd(sz.early),
            lsgd_jax.post_local_sgd_optimizer(_sgd(sz), averager, average_opt_state=_every_array),
        )

    def schedule(sz):
        return periodic(lambda s: jnp.where(s < sz.middle, 32, 8), "early")(sz)

    configs = [Config("DDP (global grads every step)", ddp)]
    for switch, hs in (("early", periods), ("middle", middle_periods)):
        for h in hs:
            configs.append(Config(f"H={h}, {switch} switch", periodic(h, switch), switch, h))
    options = {
        "outer": Config(
            "H=16 + outer Nesterov (DiLoCo)",
            periodic(16, "early", outer_optimizer=nesterov(), outer_skip_first=False),
            "early",
        ),
        "outer_anchored": Config(
            "H=16 + outer Nesterov, first outer step skipped",
            periodic(16, "early", outer_optimizer=nesterov()),  # outer_skip_first=True
            "early",
        ),
        "opt_state": Config("H=16 + momentum averaged", opt_state, "early"),
        "bf16": Config(
            "H=16, bf16 + delta",
            periodic(16, "early", communication_dtype=jnp.bfloat16, delta=True),
            "early",
            lowered=True,
        ),
        "schedule": Config("H=32 then 8 (period schedule)", schedule, "early"),
        "fragments": Config("H=16, 4 fragments", periodic(16, "early", fragments=4), "early"),
        "two_level": Config(
            "H=16, two-level mean",
            periodic(16, "early", communication=lsgd_jax.comm.two_level()),
            "early",
        ),
        "int8": Config(
            "H=16, int8 (two-level, error feedback)",
            periodic(16, "early", communication=lsgd_jax.comm.quantized(8, two_level=True)),
            "early",
        ),
        "int4": Config(
            "H=16, 4-bit (two-level, error feedback)",
            periodic(16, "early", communication=lsgd_jax.comm.quantized(4, two_level=True)),
            "early",
        ),
        "delay": Config("H=16, delay 8", periodic(16, "early", delay=8), "early"),
        "int4_delay": Config(
            "H=16, 4-bit, delay 8",
            periodic(
                16, "early", delay=8, communication=lsgd_jax.comm.quantized(4, two_level=True)
            ),
            "early",
        ),
    }
    return configs + [dataclasses.replace(options[b], option=b) for b in beyond]


# --- bytes ----------------------------------------------------------------------------


def lowered_schedule(
    tx: Any, data: digits_cnn.Digits, mesh: Any, width: int, global_batch: int, seed: int
) -> tuple[digits_cnn.Schedule, Any]:
    """The run's schedule and report from its step lowered for CUDA, not compiled here.

    The same step and arguments as ``digits_cnn.train``; only the report differs.
    """
    graphdef, params, stats = digits_cnn.init_model(width, seed)
    step = lsgd_jax.data_parallel_step(
        digits_cnn.make_loss_fn(graphdef), tx, mesh, has_aux=True, with_model_state=True
    )
    args = (
        lsgd_jax.replicate(params, mesh),
        lsgd_jax.replicate(stats, mesh),
        lsgd_jax.replicate(tx.init(params), mesh),
        next(digits_cnn.batches(data, global_batch, seed)),
    )
    report = step.communication_report(*args, platform="cuda")
    return digits_cnn.schedule_of(args[2], report, args[0]), report


def per_step_bytes(schedule: digits_cnn.Schedule, steps: int) -> np.ndarray:
    """Cross-node bytes per device of every step (``Collective.bytes``: what goes in)."""
    return np.array([schedule.cross_node_bytes(s) for s in range(steps)], np.int64)


def wire_bytes(report: Any, schedule: digits_cnn.Schedule, steps: int) -> int:
    """The run's cross-node link traffic per device (``Collective.wire_bytes``, an
    estimate for ring all-reduce etc.), charged by phase like ``per_step_bytes``."""
    branch: dict[int, int] = {}
    always = 0
    for c in digits_cnn.crossing_nodes(report):
        if c.conditional:
            branch[c.branch] = branch.get(c.branch, 0) + c.wire_bytes
        else:
            always += c.wire_bytes
    return sum(always + branch.get(schedule.branch(s), 0) for s in range(steps))


# --- running --------------------------------------------------------------------------


def run_config(
    config: Config, task: str, data: Any, mesh: Any, sizes: Sizes, args: argparse.Namespace
) -> dict:
    """Trains ``config`` once per seed; returns the aggregated row."""
    accs, seconds, curves, fit, test_loss = [], [], [], [], []
    start = config.start(sizes)
    schedule = report = cpu_schedule = None
    for seed in args.seeds:
        t0 = time.perf_counter()
        row = digits_cnn.train(
            config.name,
            config.make(sizes),
            data,
            mesh,
            steps=sizes.steps,
            global_batch=args.global_batch,
            width=args.width,
            seed=seed,
            eval_every=args.eval_every,
            progress=False,
        )
        if cpu_schedule is None:  # the same program for every seed
            cpu_schedule = schedule = row["schedule"]
            report = row["report"]
            if config.lowered:
                schedule, report = lowered_schedule(
                    config.make(sizes), data, mesh, args.width, args.global_batch, seed
                )
        elif row["schedule"].branch_bytes != cpu_schedule.branch_bytes:
            raise RuntimeError(f"{config.name}: the step differs between seeds")
        accs.append(row["test acc"])
        curves.append(row["history"]["test_acc"])
        fit.append(float(np.mean(row["history"]["loss"][-20:])))
        test_loss.append(row["test loss"])
        seconds.append(time.perf_counter() - t0)
        if args.progress:
            print(
                f"  {task:12s} {config.name:34s} seed {seed}: acc {row['test acc']:.4f}  "
                f"{seconds[-1]:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    per_step = per_step_bytes(schedule, sizes.steps)
    after = per_step[start:] if start is not None else per_step
    return {
        "task": task,
        "config": config.name,
        "switch": config.switch,
        "start": start,
        "period": config.period,
        "lowered": config.lowered,
        "option": config.option,
        "acc": accs,
        "eval_step": row["history"]["eval_step"],
        "test_acc_curve": [float(v) for v in np.mean(curves, axis=0)],
        "train_loss_end": float(np.mean(fit)),
        "test_loss_end": float(np.mean(test_loss)),
        "acc_mean": float(np.mean(accs)),
        "acc_std": float(np.std(accs, ddof=1)) if len(accs) > 1 else 0.0,
        "bytes": int(per_step.sum()),
        "cpu_bytes": int(per_step_bytes(cpu_schedule, sizes.steps).sum()),
        "peak": int(after.max()),
        "wire": wire_bytes(report, schedule, sizes.steps),
        "seconds": float(np.sum(seconds)),
    }


def add_ratios(rows: list[dict]) -> None:
    """Each row's bytes over its task's DDP row: ``ratio`` (bytes in), ``wire_ratio``
    (link traffic), ``cpu_ratio`` (what the step compiled for CPU sends)."""
    ddp = {r["task"]: r for r in rows if r["switch"] is None}
    for r in rows:
        base = ddp.get(r["task"])
        for key, field in (("ratio", "bytes"), ("wire_ratio", "wire"), ("cpu_ratio", "cpu_bytes")):
            r[key] = r[field] / base[field] if base else float("nan")


def markdown_table(rows: list[dict], seeds: list[int]) -> str:
    lines = [
        f"| configuration | test acc, % (mean ± std, {len(seeds)} seeds) | cross-node MB/device "
        "| ratio to DDP | wire ratio | peak KB/step after switch |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mb = f"{r['bytes'] / 1e6:.3f}"
        if r["lowered"]:
            mb += f" (CUDA-lowered; CPU-compiled {r['cpu_bytes'] / 1e6:.3f})"
        lines.append(
            f"| {r['config']} | {100 * r['acc_mean']:.1f} ± {100 * r['acc_std']:.1f} "
            f"| {mb} | {r['ratio']:.3f} | {r['wire_ratio']:.3f} | {r['peak'] / 1e3:.1f} |"
        )
    return "\n".join(lines)


OPTION_STYLE = {  # colour, marker, legend label
    "outer": ("tab:red", "v", "outer Nesterov (DiLoCo), anchored at init"),
    "outer_anchored": ("tab:red", "^", "outer Nesterov, first average sets the anchor"),
    "opt_state": ("tab:purple", "P", "momentum averaged too"),
    "bf16": ("tab:green", "D", "bf16 + delta (bytes lowered for CUDA)"),
    "schedule": ("tab:brown", "*", "period schedule 32 -> 8"),
    "fragments": ("tab:olive", "X", "4 fragments"),
}


def curve_table(rows: list[dict]) -> str:
    """Test accuracy during training (mean over seeds), the training loss over the last
    20 steps and the final test loss."""
    steps = rows[0]["eval_step"]
    lines = [
        "| configuration | "
        + " | ".join(f"step {s}" for s in steps)
        + " | train loss, last 20 | test loss |",
        "|---|" + "---:|" * (len(steps) + 2),
    ]
    for r in rows:
        accs = " | ".join(f"{100 * a:.1f}" for a in r["test_acc_curve"])
        lines.append(
            f"| {r['config']} | {accs} | {r['train_loss_end']:.3f} | {r['test_loss_end']:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], tasks: list[str], path: str, seeds: list[int]) -> None:
    """Accuracy against bytes, one panel per task; the H=16 variants share their bytes,
    so the options beyond PyTorch are spread a little apart horizontally (see the note)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    # one panel above the other, at about the width a docs page shows it (readable there)
    fig, axes = plt.subplots(len(tasks), 1, figsize=(7.5, 4.6 * len(tasks) + 1.8), squeeze=False)
    for ax, task in zip(axes[:, 0], tasks):
        task_rows = [r for r in rows if r["task"] == task]
        for r in task_rows:
            x, y = r["bytes"] / 1e6, 100 * r["acc_mean"]
            same = [q for q in task_rows if abs(q["bytes"] / r["bytes"] - 1) < 0.01]
            x *= 1.025 ** (same.index(r) - (len(same) - 1) / 2)  # dodge equal bytes
            below = (5, -11)
            if r["option"]:
                color, marker, label = *OPTION_STYLE[r["option"]][:2], None
            elif r["switch"] is None:
                color, marker, label = "k", "s", "DDP"
            elif r["switch"] == "early":
                color, marker, label = "tab:blue", "o", f"H={r['period']}"
            else:
                color, marker, label = "tab:orange", "o", f"H={r['period']}"
                below = (5, 4)
            ax.errorbar(
                x, y, yerr=100 * r["acc_std"], fmt=marker, color=color, capsize=3,
                markersize=9 if marker == "*" else 6,
            )  # fmt: skip
            if label:
                ax.annotate(label, (x, y), fontsize=10, xytext=below, textcoords="offset points")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_xlabel("cross-node MB per device over the run (log)")
        ax.set_ylabel(f"test accuracy, %\n(mean ± std, {len(seeds)} seeds)")
        ax.set_title(task)
        ax.grid(True, which="both", alpha=0.3)
    handles = [
        plt.Line2D([], [], color=c, marker=m, ls="", label=lab)
        for c, m, lab in [
            ("k", "s", "DDP"),
            ("tab:blue", "o", "post-local SGD, early switch"),
            ("tab:orange", "o", "post-local SGD, middle switch"),
            *OPTION_STYLE.values(),
        ]
    ]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=10, frameon=False)
    fig.suptitle(
        "Test accuracy against cross-node traffic, 2 nodes x 4 devices\n"
        "(options beyond PyTorch: early switch, H = 16 unless named;\n"
        "equal bytes spread apart by a few %)",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny, for CI: " + " ".join(QUICK))
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--early", type=int, default=None, help="early switch (default steps/8)")
    parser.add_argument("--periods", type=int, nargs="*", default=[2, 4, 8, 16, 32])
    parser.add_argument("--middle-periods", type=int, nargs="*", default=[4, 16])
    parser.add_argument("--beyond", nargs="*", default=list(BEYOND), choices=BEYOND + COMM)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--width", type=int, default=8, help="channels of the first conv")
    parser.add_argument("--lr", type=float, default=0.1, help="peak learning rate")
    parser.add_argument("--eval-every", type=int, default=None, help="default: only at the end")
    parser.add_argument("--plot", default=None, help="save the plot here (PNG)")
    parser.add_argument("--progress", action="store_true", help="a line per run on stderr")
    parser.add_argument("--json", default=None, help="also save the rows here")
    parser.add_argument(
        "--from-json", default=None, help="print and plot the rows saved there; train nothing"
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.quick:  # the quick sizes, unless given explicitly after --quick
        args = parser.parse_args(QUICK + argv)
    if args.early is None:
        args.early = args.steps // 8
    if args.eval_every is None:
        args.eval_every = args.steps
    return args


def describe(task: str, args: argparse.Namespace) -> str:
    data = load_task(task)
    return (
        f"**{task}**: {len(data.y_train)} training / {len(data.y_test)} test images; "
        f"{args.steps} steps of {args.global_batch} images ({args.global_batch // 8} per "
        f"device), CNN width {args.width}, peak lr {args.lr}; early switch at step "
        f"{args.early}, middle at {args.steps // 2}. Std: sample std over the seeds."
    )


def main(argv: list[str] | None = None) -> list[dict]:
    """Runs the benchmark (or reads ``--from-json``); prints the tables, returns the rows."""
    args = parse_args(argv)
    command = " ".join(["python benchmarks/accuracy.py", *(sys.argv[1:] if argv is None else argv)])
    t0 = time.perf_counter()
    if args.from_json:
        saved = json.loads(pathlib.Path(args.from_json).read_text())
        rows, command = saved["rows"], saved["command"]
        plot_path, args = args.plot, parse_args(saved["argv"])  # the saved run's sizes
        args.plot, args.json = plot_path, None
    else:
        rows = train_all(args)
    print(f"`{command}`\n")
    for task in args.tasks:
        print(describe(task, args) + "\n")
        print(markdown_table([r for r in rows if r["task"] == task], args.seeds))
        print()
        if args.eval_every < args.steps:
            print(curve_table([r for r in rows if r["task"] == task]) + "\n")
    print(f"Total time {time.perf_counter() - t0:.0f} s.")
    if args.json and not args.from_json:
        argv_list = sys.argv[1:] if argv is None else list(argv)
        saved = {"command": command, "argv": argv_list, "rows": rows}
        pathlib.Path(args.json).write_text(json.dumps(saved, indent=1) + "\n")
    if args.plot:
        plot(rows, args.tasks, args.plot, args.seeds)
        print(f"Plot: {args.plot}")
    return rows


def train_all(args: argparse.Namespace) -> list[dict]:
    """Every configuration on every task, each over the seeds; rows with their ratios."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    digits_cnn.setup_cpu_devices(8)
    mesh = lsgd_jax.make_mesh(num_nodes=2, devices_per_node=4)
    sizes = Sizes(args.steps, args.early, args.lr)
    configs = make_configs(args.periods, args.middle_periods, args.beyond)
    rows = []
    for task in args.tasks:
        data = load_task(task)
        for config in configs:
            rows.append(run_config(config, task, data, mesh, sizes, args))
    add_ratios(rows)
    return rows


def cache_compilations() -> None:
    """Caches compiled programs in a temporary folder for this process's lifetime: the
    seeds of a configuration compile the same program (about 4 s each, saved).

    Only for a fresh process (the command line): JAX decides once per process, at its
    first compilation, whether it uses the cache, and keeps writing to the folder after.
    """
    folder = tempfile.mkdtemp(prefix="lsgd_accuracy_jit_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


if __name__ == "__main__":
    cache_compilations()
    main()
