"""Digits CNN (Flax NNX): DDP against post-local SGD, flat and hierarchical, on 2 x 4 devices.

Run ``python examples/digits_cnn.py`` (about a minute on 2 CPU cores), or with ``--quick``
(48 steps, about 20 s, most of it compiling the four steps). It trains one small
convolutional network with batch normalization on scikit-learn's digits (8x8 images, 10
classes, shipped with scikit-learn) on 8 simulated CPU devices arranged as 2 nodes x 4
devices (``lsgd_jax.make_mesh(2, 4)``), four times with the same data order and seed:

- DDP: ``post_local_sgd(start_localSGD_iter=steps)``, so gradients are averaged over all
  8 replicas on every step (what a plain data-parallel step does).
- post-local SGD, H=4 and H=16: global gradient averaging for ``--start`` steps, then
  gradients averaged inside each node only, and the models averaged over all 8 replicas
  every H steps (``PeriodicModelAverager(H, warmup_steps=start)``).
- hierarchical: ``post_local_sgd(start, post_local_gradient_allreduce=False)`` with
  ``HierarchicalModelAverager({2: "local", 16: ("node", "local")}, warmup_steps=start)``.
  After the switch each device takes its own SGD steps (no gradient averaging at all);
  the 4 devices of a node average their models every 2 steps over the fast intra-node
  links, and all 8 average every 16 steps, across nodes. It makes the same cross-node
  traffic as H=16 but half as many intra-node all-reduces (one every 2 steps instead of a
  gradient all-reduce every step). Keeping the node-local gradient all-reduce
  (``post_local_gradient_allreduce=True``) would make the intra-node model average a
  no-op: the replicas of a node would already be identical. ``--start`` is a multiple
  of 16, so the hierarchy, which counts periods from step 0, averages globally at the
  switch step like the periodic averager does.

The parameters and the batch-norm statistics are per replica (``lsgd_jax.replicate``);
``data_parallel_step(..., with_model_state=True)`` averages the statistics on the same
steps and over the same group as the parameters. (In the DDP run nothing averages them:
each replica keeps the running statistics of its own batches, and the evaluated model
takes their mean.) The table reports the test accuracy of the consensus model (the mean
of the replicas, ``lsgd_jax.consensus``), the number of global (cross-node) all-reduces
of the schedule (the hook's ``iter`` counts the global gradient all-reduces; the
averager's top level the global model averages), and the bytes each device sends into
cross-node all-reduces, from the compiled step (``lsgd_jax.communication_report``).
``seconds`` is the wall time of the training loop (compilation excluded); on simulated
devices a cross-node all-reduce is a memory copy like any other, so it does not show
what the saved traffic is worth on a real cluster.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits as sklearn_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import lsgd_jax

# Importing this module starts no JAX backend: a caller (the notebook) can pick devices after.
QUICK = ["--steps", "48", "--start", "16", "--eval-every", "16", "--width", "8"]
CROSS_NODE = ("node", "local")


def crossing_nodes(report: Any) -> Any:
    """The collectives of ``report`` whose groups span nodes: over both axes, or over
    ``"node"`` alone (a two-level mean's step between nodes); not the one-time copy of a
    common anchor before the first global average (``delta``), which this per-branch
    accounting would otherwise charge at every average."""
    return report.__class__(
        c for c in report if "node" in c.axes and "common_anchor" not in c.scope
    )


def setup_cpu_devices(n: int = 8) -> None:
    """Asks for ``n`` simulated CPU devices, with the threads they need, unless JAX was
    told to use another platform (``JAX_PLATFORMS=cuda``); call before JAX starts its
    backend."""
    if jax.config.jax_platforms in (None, "", "cpu"):
        lsgd_jax.mesh.simulate_cpu_devices(n)


@dataclasses.dataclass(frozen=True)
class Digits:
    """scikit-learn's digits, scaled to [0, 1], as NHWC images; a stratified split."""

    x_train: Any
    y_train: Any
    x_test: Any
    y_test: Any


def load_digits(seed: int = 0, test_fraction: float = 0.2) -> Digits:
    x, y = sklearn_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y.astype(np.int32), test_size=test_fraction, random_state=seed, stratify=y
    )
    return Digits(x_tr, y_tr, x_te, y_te)


def batches(data: Digits, global_batch: int, seed: int) -> Iterator[dict]:
    """Endless shuffled epochs of global batches (the last partial batch is dropped)."""
    rng = np.random.default_rng(seed)
    n = len(data.y_train)
    while True:
        order = rng.permutation(n)
        for i in range(0, n - global_batch + 1, global_batch):
            idx = order[i : i + global_batch]
            yield {"x": data.x_train[idx], "y": data.y_train[idx]}


class CNN(nnx.Module):
    """conv-BN-relu, conv-relu, 2x2 average pool, linear: about 10k parameters at width 16."""

    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, width, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(width, momentum=0.9, rngs=rngs)
        self.conv2 = nnx.Conv(width, 2 * width, (3, 3), rngs=rngs)
        self.head = nnx.Linear(2 * width * 4 * 4, 10, rngs=rngs)

    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        x = nnx.relu(self.bn1(self.conv1(x), use_running_average=not train))
        x = nnx.avg_pool(nnx.relu(self.conv2(x)), (2, 2), strides=(2, 2))
        return self.head(x.reshape(x.shape[0], -1))


def init_model(width: int, seed: int) -> tuple[Any, Any, Any]:
    """``(graphdef, params, batch_stats)`` of a fresh CNN, by ``nnx.split``."""
    # An "rbg" key: XLA compiles its random sampling in a fraction of a second on CPU; the
    # default (threefry) takes 1-3 s per weight shape, longer than --quick trains.
    model = CNN(width, rngs=nnx.Rngs(jax.random.key(seed, impl="rbg")))
    return nnx.split(model, nnx.Param, nnx.BatchStat)


def make_loss_fn(graphdef: Any):
    """The per-replica loss for ``data_parallel_step(has_aux=True, with_model_state=True)``."""

    def loss_fn(params, batch_stats, batch):
        # copy=True: fresh Variables in this trace, so BatchNorm may update its statistics
        # under jax.grad (the incoming ones belong to the enclosing shard_map trace).
        model = nnx.merge(graphdef, params, batch_stats, copy=True)
        logits = model(batch["x"], train=True)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        correct = jnp.sum(jnp.argmax(logits, -1) == batch["y"]).astype(jnp.int32)
        return loss, (nnx.state(model, nnx.BatchStat), {"correct": correct})

    return loss_fn


@functools.partial(jax.jit, static_argnums=0)
def evaluate(graphdef: Any, params: Any, batch_stats: Any, x: jax.Array, y: jax.Array):
    """``(loss, accuracy)`` of one (unreplicated) model, with its running statistics."""
    logits = nnx.merge(graphdef, params, batch_stats, copy=True)(x, train=False)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == y)


def make_runs(
    steps: int, start: int, periods: list[int], hierarchy: dict[int, Any], lr: float
) -> list[tuple[str, Any]]:
    """The (name, optax optimizer) pairs to compare; SGD with momentum in all of them."""

    def sgd():
        return optax.sgd(lr, momentum=0.9)

    runs = [("DDP (global grads every step)", optax.chain(lsgd_jax.post_local_sgd(steps), sgd()))]
    for h in periods:
        averager = lsgd_jax.PeriodicModelAverager(h, warmup_steps=start)
        tx = optax.chain(lsgd_jax.post_local_sgd(start), sgd(), lsgd_jax.model_averaging(averager))
        runs.append((f"post-local SGD, H={h}", tx))
    if hierarchy:
        averager = lsgd_jax.HierarchicalModelAverager(hierarchy, warmup_steps=start)
        tx = optax.chain(
            lsgd_jax.post_local_sgd(start, post_local_gradient_allreduce=False),
            sgd(),
            lsgd_jax.model_averaging(averager),
        )
        levels = "/".join(str(p) for p in hierarchy)
        runs.append((f"hierarchical, H={levels}", tx))
    return runs


def _hook_state(opt_state: Any) -> Any:
    is_hook = lambda x: isinstance(x, lsgd_jax.PostLocalSGDState)  # noqa: E731
    (hook,) = [x for x in jax.tree.leaves(opt_state, is_leaf=is_hook) if is_hook(x)]
    return hook


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which all-reduces a run makes on which step, and what each cross-node one carries.

    Which branch of the step each step takes is the library's own replay
    (``lsgd_jax.replay_phases``), and the averaging levels the averager's
    (``averager.schedule``): nothing of the rule is written again here.

    Attributes:
      opt_state: the optimizer state the run starts from (its counters and static
        configuration).
      branch_bytes: cross-node bytes per device of each phase branch of the step.
      always_bytes: bytes per device of the cross-node all-reduces of every step (the
        reported mean loss and summed correct count).
    """

    opt_state: Any
    branch_bytes: dict
    always_bytes: int
    _replays: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def hook(self) -> Any:
        return _hook_state(self.opt_state)

    @property
    def start(self) -> int:
        return self.hook.start_localSGD_iter

    @property
    def averager(self) -> Any:
        states = lsgd_jax.averager_states(self.opt_state)
        return states[0].averager if states else None

    def phases(self, steps: int) -> np.ndarray:
        """The step's branch (``lsgd_jax.phase_index``) at each of the first ``steps``."""
        if steps not in self._replays:
            self._replays[steps] = lsgd_jax.replay_phases(self.opt_state, steps)
        return self._replays[steps]

    def levels(self, steps: int) -> np.ndarray:
        """The averager's level at each of the first ``steps`` (0: no average)."""
        return self.averager.schedule(steps) if self.averager else np.zeros(steps, np.int32)

    def branch(self, step: int) -> int:
        return int(self.phases(1 << int(step).bit_length())[step])

    @property
    def grad_bytes(self) -> int:
        """Cross-node bytes of a step that only all-reduces the gradients globally."""
        return self.branch_bytes.get(self.branch(0), 0) if self.start else 0

    @property
    def average_bytes(self) -> int:
        """Cross-node bytes of a global model average (params + batch statistics)."""
        if self.averager is None:
            return 0
        horizon = self.start + 2 * (self.averager.cycle or 64) + 1
        levels, phases = self.levels(horizon), self.phases(horizon)
        hits = [s for s in range(horizon) if self.averager.is_global(int(levels[s]))]
        return self.branch_bytes.get(int(phases[hits[0]]), 0) if hits else 0

    def cross_node_bytes(self, step: int) -> int:
        """Bytes this device sends across nodes on ``step`` (0-based)."""
        return self.always_bytes + self.branch_bytes.get(self.branch(step), 0)

    def counts(self, steps: int) -> dict[str, int]:
        """Global and node-local all-reduces of the first ``steps`` steps (not metrics)."""
        grad_global = min(steps, self.start)
        levels = self.levels(steps).tolist()
        is_global = self.averager.is_global if self.averager else bool
        avg_global = sum(1 for v in levels if v and is_global(v))
        avg_local = sum(1 for v in levels if v and not is_global(v))
        grad_local = steps - grad_global if self.hook.post_local_gradient_allreduce else 0
        return {
            "grad_global": grad_global,
            "avg_global": avg_global,
            "global": grad_global + avg_global,
            "local": grad_local + avg_local,
        }


def schedule_of(opt_state: Any, report: Any, params: Any) -> Schedule:
    """Reads a run's schedule off its (replicated) optimizer state and compiled step.

    ``data_parallel_step`` traces the step once per phase (hook: global or node-local
    gradients; averager: its level) under one switch, and XLA may merge the collectives
    of one branch: so the bytes are read per branch, and each step is charged the bytes
    of the branch its phase takes.
    """
    hook = _hook_state(opt_state)
    branch_bytes: dict[int, int] = {}
    cross = crossing_nodes(report)
    for c in cross:
        if c.conditional:
            branch_bytes[c.branch] = branch_bytes.get(c.branch, 0) + c.bytes
    is_state = lambda x: isinstance(x, (lsgd_jax.PostLocalSGDState, lsgd_jax.ModelAveragerState))  # noqa: E731
    states = [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]
    schedule = Schedule(
        opt_state=jax.device_get(states),  # the counters at the start (the step donates)
        branch_bytes=branch_bytes,
        always_bytes=sum(c.bytes for c in cross if not c.conditional),
    )
    floating = [x for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.inexact)]
    if hook.start_localSGD_iter and schedule.grad_bytes != sum(
        x.nbytes // x.shape[0] for x in floating
    ):
        raise RuntimeError(f"the compiled step has no cross-node gradient all-reduce:\n{report}")
    return schedule


def train(
    name: str,
    tx: Any,
    data: Digits,
    mesh: Any,
    *,
    steps: int,
    global_batch: int = 128,
    width: int = 16,
    seed: int = 0,
    eval_every: int = 16,
    progress: bool = True,
) -> dict[str, Any]:
    """Trains one run; returns its table row, with its per-step ``history`` and ``report``."""
    graphdef, params0, stats0 = init_model(width, seed)
    step = lsgd_jax.data_parallel_step(
        make_loss_fn(graphdef), tx, mesh, has_aux=True, with_model_state=True
    )
    params = lsgd_jax.replicate(params0, mesh)
    batch_stats = lsgd_jax.replicate(stats0, mesh)
    opt_state = lsgd_jax.replicate(tx.init(params0), mesh)
    data_iter = batches(data, global_batch, seed)
    first = next(batches(data, global_batch, seed))
    report = step.communication_report(params, batch_stats, opt_state, first)
    schedule = schedule_of(opt_state, report, params)

    def test_metrics():
        model = lsgd_jax.consensus((params, batch_stats))  # the mean of the replicas
        loss, acc = evaluate(graphdef, *model, data.x_test, data.y_test)
        return float(loss), float(acc)

    evals = [(0, *test_metrics())]
    losses, correct = [], []
    t0 = time.perf_counter()
    for s in tqdm(range(steps), desc=name, disable=not progress):
        params, batch_stats, opt_state, loss, aux = step(
            params, batch_stats, opt_state, next(data_iter)
        )
        losses.append(loss)
        correct.append(aux["correct"])
        if (s + 1) % eval_every == 0 or s + 1 == steps:
            evals.append((s + 1, *test_metrics()))
    seconds = time.perf_counter() - t0

    counts = schedule.counts(steps)
    hook_iter = int(np.asarray(_hook_state(opt_state).iter)[0])  # PyTorch's iter
    if hook_iter != counts["grad_global"]:
        raise RuntimeError(f"hook iter {hook_iter} != schedule {counts['grad_global']}")
    cum_bytes = np.cumsum([schedule.cross_node_bytes(s) for s in range(steps)])
    eval_step, test_loss, test_acc = (list(v) for v in zip(*evals))
    history = {
        "step": list(range(1, steps + 1)),
        "loss": [float(v) for v in losses],
        "train_acc": [int(v) / global_batch for v in correct],
        "cross_node_bytes": [int(v) for v in cum_bytes],
        "eval_step": eval_step,
        "eval_cross_node_bytes": [int(cum_bytes[s - 1]) if s else 0 for s in eval_step],
        "test_loss": test_loss,
        "test_acc": test_acc,
    }
    return {
        "run": name,
        "train loss": history["loss"][-1],
        "test loss": test_loss[-1],
        "test acc": test_acc[-1],
        "global all-reduces": counts["global"],
        "cross-node MB/device": float(cum_bytes[-1]) / 1e6,
        "node-local all-reduces": counts["local"],
        "seconds": seconds,
        "history": history,
        "report": report,
        "schedule": schedule,
    }


COLUMNS = {
    "run": "{}",
    "train loss": "{:.4f}",
    "test loss": "{:.4f}",
    "test acc": "{:.3f}",
    "global all-reduces": "{}",
    "cross-node MB/device": "{:.3f}",
    "node-local all-reduces": "{}",
    "seconds": "{:.1f}",
}


def format_table(rows: list[dict]) -> str:
    """The rows as an aligned text table (the COLUMNS only)."""
    table = [list(COLUMNS)] + [[f.format(r[c]) for c, f in COLUMNS.items()] for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(v.rjust(w) if j else v.ljust(w) for j, (v, w) in enumerate(zip(r, widths)))
        for r in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, for CI: " + " ".join(QUICK)
    )
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--start", type=int, default=64, help="start_localSGD_iter (= warm-up)")
    parser.add_argument("--periods", type=int, nargs="*", default=[4, 16])
    parser.add_argument(
        "--hierarchy",
        type=int,
        nargs="*",
        default=[2, 16],
        help="LOCAL GLOBAL periods of the hierarchical run; none to skip it",
    )
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--width", type=int, default=16, help="channels of the first conv")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--eval-every", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.quick:  # the quick sizes, unless given explicitly after --quick
        args = parser.parse_args(QUICK + argv)
    if args.hierarchy and len(args.hierarchy) != 2:
        parser.error("--hierarchy takes two periods: LOCAL GLOBAL (e.g. 2 16)")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    """Runs the comparison; prints and returns the rows (with histories)."""
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    setup_cpu_devices(8)
    lsgd_jax.use_compilation_cache()  # a rerun loads its programs instead of compiling

    mesh = lsgd_jax.make_mesh(num_nodes=2, devices_per_node=4)
    data = load_digits(args.seed)
    hierarchy = dict(zip(args.hierarchy, ["local", CROSS_NODE])) if args.hierarchy else {}
    runs = make_runs(args.steps, args.start, args.periods, hierarchy, args.lr)
    rows = [
        train(
            name,
            tx,
            data,
            mesh,
            steps=args.steps,
            global_batch=args.global_batch,
            width=args.width,
            seed=args.seed,
            eval_every=args.eval_every,
            progress=not args.no_progress,
        )
        for name, tx in runs
    ]
    print(
        f"digits CNN, {args.steps} steps of {args.global_batch} images, 2 nodes x 4 devices, "
        f"local SGD from step {args.start}; test acc of the consensus model, "
        f"{len(data.y_test)} test images"
    )
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
