"""Byte-level language model (Flax NNX): DDP, post-local SGD and DiLoCo on 2 x 4 devices.

Run ``python examples/lm.py --compare ddp,local8,local32,diloco --plot lm.png`` (the
default model, about 0.48M parameters), or ``python examples/lm.py --method local
--period 8``; ``--quick`` trains a tiny model for a few steps (CI sizes). It trains a
decoder-only transformer on bytes of text that ships with Python, the standard library's
own sources (``*.py`` under ``sysconfig.get_paths()["stdlib"]``, read in sorted order up
to ``--max-mb``; a file is held out for validation when the CRC-32 of its relative path
is 0 mod 10, so the split is by file and the same on every run; nothing is downloaded),
on 8 simulated CPU devices arranged as 2 nodes x 4 devices (``lsgd_jax.make_mesh(2,
4)``). Every method uses AdamW with linear warm-up and cosine decay; what differs is one
optax chain (:func:`make_tx`):

- ``ddp``: gradients averaged over all 8 replicas on every step
  (``post_local_sgd(start_localSGD_iter=steps)``).
- ``localH`` (``--method local --period H``): post-local SGD. Global gradient means for
  ``--start`` steps, then gradient means inside each node only and a global model average
  every H steps (``PeriodicModelAverager(H, warmup_steps=start)``).
- ``dilocoH`` (``--method diloco``, H=32 by default): the same, but each global average
  is an outer Nesterov step on the averaged change since the last one
  (``outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True)``), DiLoCo's recipe.
- ``--bits 4``: the global averages travel as 4-bit integers, two-level
  (``comm.quantized(4, two_level=True)``); ``--delay D``: each global average lands D
  steps after it starts (``delay=D``). In ``--compare`` a run takes them as suffixes:
  ``local32:bits4:delay1``.

Reported: the validation loss of the consensus model (the mean of the replicas) in nats
per byte on the held-out files, every ``--eval-every`` steps; the cross-node bytes each
device sends, per step, from the compiled programs and the schedule
(``lsgd_jax.communication_ledger``, nothing run to count them); and an emulated
wall-clock time on a slow link between the two nodes::

    time(s) = s * c + 8 * W(s) / rate + M(s) * latency

where ``c`` is the measured compute time of a step (the median step time of the run; on
simulated devices a collective is a memory copy; ``--compute-ms`` sets it instead, e.g.
to compare runs measured under different loads), ``W(s)`` the cross-node wire bytes one
device has sent by step ``s`` (``ledger.per_step(wire=True)``: a ring all-reduce sends
``2 (g - 1) / g`` times its input), ``M(s)`` the number of cross-node collectives run by
then (each pays one ``latency``), ``rate`` ``--link-mbit`` (100 Mbit/s) and ``latency``
``--latency-ms`` (1 ms). It charges each device's cross-node traffic a link of its own:
devices of a node that share one network card would pay more. At the end each run
prints one JSON line (``--json`` writes them to a file), and ``--plot out.png`` draws
validation loss against cross-node bytes and against emulated time.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import statistics
import sys
import sysconfig
import time
import zlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import lsgd_jax

# Importing this module starts no JAX backend: a caller (a test) can pick devices after.
QUICK = [
    *("--steps", "12", "--start", "4", "--eval-every", "4", "--warmup", "2"),
    *("--layers", "1", "--width", "32", "--heads", "2", "--context", "32"),
    *("--global-batch", "16", "--max-mb", "0.5", "--val-windows", "16"),
]
# Named recipes: flags that --recipe puts first (later flags override them).
# slow-link (issue 29, benchmarks/RESULTS.md part 8): DDP's validation loss (ahead of it on
# seeds 0, 1, 2) at 1/102 of its bytes on the links between nodes over 1,500 steps,
# warm-up included (1/155 of its per-device cross-node bytes): a 4-bit two-level
# warm-up of 100 steps, then DiLoCo at H=32 with 8-bit two-level averages and an outer
# Nesterov step (lr 0.7, momentum 0.8) that cools down into a plain average over its
# last 30%.
RECIPES = {
    "slow-link": [
        *("--compare", "diloco32", "--bits", "8", "--warmup-bits", "4", "--start", "100"),
        *("--outer-momentum", "0.8", "--outer-cooldown", "0.3"),
        *("--steps", "1500", "--warmup", "50", "--eval-every", "100"),
    ],
}
INNER_AXES = ("local",)  # the mesh axis of one node's devices
DILOCO_OUTER = {"learning_rate": 0.7, "momentum": 0.9, "nesterov": True}


def setup_cpu_devices(n: int = 8, platform: str = "cpu") -> None:
    """Asks for ``n`` simulated CPU devices (``platform="cpu"``); ``"gpu"`` leaves the
    choice to JAX (its accelerators). Call before JAX starts its backend."""
    if platform == "cpu" and jax.config.jax_platforms in (None, "", "cpu"):
        os.environ.setdefault("PJRT_NPROC", str(2 * n))
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)


def peak_device_bytes() -> int | None:
    """The largest peak of memory in use on any local device (None where the backend
    does not say, e.g. CPU)."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    return max((p for p in peaks if p is not None), default=None)


# ----------------------------------------------------------------------------- data


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The bytes of the standard library's sources, split by file.

    Attributes:
      train: the training files' bytes, concatenated (uint8).
      val: the held-out files' bytes, concatenated (uint8).
      train_files: the training files, relative to the stdlib folder, in order.
      val_files: the held-out files, likewise.
    """

    train: np.ndarray
    val: np.ndarray
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]


def is_held_out(relative_path: str) -> bool:
    """Whether a file goes to the validation split: CRC-32 of its path is 0 mod 10."""
    return zlib.crc32(relative_path.encode()) % 10 == 0


@functools.lru_cache(maxsize=4)
def stdlib_files(root: pathlib.Path) -> tuple[pathlib.Path, ...]:
    """The ``*.py`` files under ``root`` (the standard library), sorted; no installed
    packages."""
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return tuple(sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)))


def load_corpus(max_mb: float = 4.0, root: pathlib.Path | None = None) -> Corpus:
    """Reads the sources in sorted order until the training split holds ``max_mb`` MB
    (the held-out split stops at a tenth of that)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    limit = int(max_mb * 1e6)
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    names: dict[bool, list[str]] = {False: [], True: []}
    sizes = {False: 0, True: 0}
    for path in stdlib_files(root):
        if sizes[False] >= limit and sizes[True] >= limit // 10:
            break
        name = path.relative_to(root).as_posix()
        held = is_held_out(name)
        if sizes[held] >= (limit // 10 if held else limit):
            continue
        text = path.read_bytes()
        parts[held].append(text)
        names[held].append(name)
        sizes[held] += len(text)
    as_array = lambda held: np.frombuffer(b"".join(parts[held]), np.uint8)  # noqa: E731
    return Corpus(as_array(False), as_array(True), tuple(names[False]), tuple(names[True]))


def batches(data: np.ndarray, global_batch: int, context: int, seed: int) -> Iterator[dict]:
    """Endless global batches of ``context + 1`` consecutive bytes at random offsets."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - context - 1, global_batch)
        yield {"tokens": np.stack([data[s : s + context + 1] for s in starts]).astype(np.int32)}


def validation_windows(data: np.ndarray, count: int, context: int) -> np.ndarray:
    """``count`` windows of ``context + 1`` bytes, evenly spaced over the held-out split."""
    starts = np.linspace(0, len(data) - context - 1, count).astype(np.int64)
    return np.stack([data[s : s + context + 1] for s in starts]).astype(np.int32)


# ----------------------------------------------------------------------------- model


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The transformer's sizes: layers, width (model dimension), heads, context length."""

    layers: int = 2
    width: int = 128
    heads: int = 4
    context: int = 128


class Block(nnx.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, width: int, heads: int, *, rngs: nnx.Rngs):
        self.heads = heads
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.qkv = nnx.Linear(width, 3 * width, rngs=rngs)
        self.proj = nnx.Linear(width, width, rngs=rngs)
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
        q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.heads)
        causal = jnp.tril(jnp.ones((t, t), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        x = x + self.proj(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d))
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class ByteLM(nnx.Module):
    """Decoder-only transformer over bytes: 256-symbol embedding, learned positions."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(256, config.width, rngs=rngs)
        init = nnx.initializers.normal(0.02)
        self.position = nnx.Param(init(rngs.params(), (config.context, config.width)))
        self.blocks = nnx.List(
            [Block(config.width, config.heads, rngs=rngs) for _ in range(config.layers)]
        )
        self.norm = nnx.LayerNorm(config.width, rngs=rngs)
        self.head = nnx.Linear(config.width, 256, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


@functools.lru_cache(maxsize=4)  # every run of a comparison starts from the same model
def init_model(config: ModelConfig, seed: int) -> tuple[Any, Any]:
    """``(graphdef, params)`` of a fresh model, by ``nnx.split``, initialized in one jit."""

    def build() -> ByteLM:
        # An "rbg" key: XLA compiles its sampling much faster on CPU than threefry's.
        return ByteLM(config, rngs=nnx.Rngs(jax.random.key(seed, impl="rbg")))

    graphdef, _ = nnx.split(nnx.eval_shape(build), nnx.Param)
    params = jax.jit(lambda: nnx.split(build(), nnx.Param)[1])()
    return graphdef, params


def next_byte_loss(graphdef: Any, params: Any, tokens: jax.Array) -> jax.Array:
    """Mean cross-entropy (nats per byte) of predicting each byte from those before it."""
    logits = nnx.merge(graphdef, params, copy=True)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def make_loss_fn(graphdef: Any):
    """The per-replica loss for ``data_parallel_step``: ``loss_fn(params, batch)``."""
    return lambda params, batch: next_byte_loss(graphdef, params, batch["tokens"])


@functools.partial(jax.jit, static_argnums=0)
def evaluate(graphdef: Any, params: Any, tokens: jax.Array) -> jax.Array:
    """Validation loss (nats per byte) of one (unreplicated) model."""
    return next_byte_loss(graphdef, params, tokens)


# ----------------------------------------------------------------------------- methods


@dataclasses.dataclass(frozen=True)
class Method:
    """One run's configuration: ``ddp``, ``local`` or ``diloco``, with its period
    (H), the bits of its averages (0: float32) and their delay."""

    kind: str
    period: int = 0
    bits: int = 0
    delay: int = 0

    @property
    def name(self) -> str:
        """A short label: ``ddp``, ``local8``, ``diloco32:bits4:delay1``."""
        if self.kind == "ddp":
            return "ddp"
        extra = (f":bits{self.bits}" if self.bits else "") + (
            f":delay{self.delay}" if self.delay else ""
        )
        return f"{self.kind}{self.period}{extra}"


def parse_method(spec: str, period: int = 0, bits: int = 0, delay: int = 0) -> Method:
    """``"local8"``, ``"diloco"``, ``"local32:bits4:delay1"``: a :class:`Method`; a
    part missing from ``spec`` comes from the arguments (diloco's period defaults to 32)."""
    head, *options = spec.strip().split(":")
    kind = head.rstrip("0123456789")
    if kind not in ("ddp", "local", "diloco"):
        raise ValueError(f"unknown method {spec!r}: use ddp, localH or dilocoH (e.g. local8)")
    if kind == "ddp":
        return Method("ddp")
    digits = head[len(kind) :]
    h = int(digits) if digits else (period or (32 if kind == "diloco" else 8))
    values = {"bits": bits, "delay": delay}
    for option in options:
        key = option.rstrip("0123456789")
        if key not in values or key == option:
            raise ValueError(f"unknown option {option!r} in {spec!r}: use bitsN or delayN")
        values[key] = int(option[len(key) :])
    return Method(kind, h, values["bits"], values["delay"])


def outer_options(
    lr: float,
    momentum: float,
    decay: tuple[int, int, Any] | None = None,
    *,
    floor: float = 0.0,
    cooldown: float = 0.0,
) -> dict:
    """DiLoCo's outer step, as ``optax.sgd`` keywords (Nesterov momentum). ``decay=(steps,
    start, period)``: the learning rate falls along a cosine over the run's outer steps
    (one at the switch, then every ``period``) to ``floor`` times ``lr``, so that the
    momentum stops moving the model when the inner learning rate has decayed (without
    it, the validation loss rose over the last 100 of 1,500 steps: benchmarks/RESULTS.md
    part 8). ``cooldown`` (a fraction of the outer steps, instead of the cosine):
    ``lsgd_jax.averaging.diloco_outer``, which stays Nesterov(``lr``, ``momentum``) and
    over the last ``cooldown`` of the outer steps turns linearly into a plain average
    (learning rate 1, no momentum); the options then hold ``cooldown`` and
    ``outer_steps`` too, and :func:`outer_optimizer` builds it."""
    if decay is None:
        return {"learning_rate": lr, "momentum": momentum, "nesterov": True}
    steps, start, period = decay
    outer_steps = lsgd_jax.averaging.num_outer_steps(steps, start, period)
    if cooldown:
        return {"learning_rate": lr, "momentum": momentum, "nesterov": True,
                "cooldown": cooldown, "outer_steps": outer_steps}  # fmt: skip
    schedule = optax.cosine_decay_schedule(lr, outer_steps, alpha=floor)
    return {"learning_rate": schedule, "momentum": momentum, "nesterov": True}


def outer_optimizer(outer: dict[str, Any]) -> optax.GradientTransformation:
    """``optax.sgd(**outer)``; with a cool-down (:func:`outer_options`)
    ``lsgd_jax.averaging.diloco_outer``."""
    if "cooldown" in outer:
        return lsgd_jax.averaging.diloco_outer(
            outer["outer_steps"],
            outer["learning_rate"],
            outer["momentum"],
            cooldown=outer["cooldown"],
        )
    return optax.sgd(**outer)


def make_tx(
    method: Method,
    *,
    steps: int,
    start: int,
    lr: float,
    warmup: int,
    outer: dict[str, Any] | None = None,
    warmup_bits: int = 0,
    final: tuple[int, int] | None = None,
    qsr: float = 0.0,
) -> Any:
    """The optax chain of a method: hook, AdamW (warm-up, cosine decay), averager
    (DiLoCo's outer step: ``optax.sgd(**outer)``, default :data:`DILOCO_OUTER`).
    ``warmup_bits`` (8 or 4; not DDP): the hook's global gradient means before the
    switch quantized, two-level, with error feedback in the hook's state. ``final=(period,
    steps)``: the averages come every ``period`` steps over the run's last ``steps``;
    ``qsr``: the period grows as the learning rate decays (:func:`averaging_period`)."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1))
    adamw = optax.adamw(schedule, b2=0.99, weight_decay=0.1)
    if method.kind == "ddp":  # the hook never switches: a global gradient mean every step
        return optax.chain(lsgd_jax.post_local_sgd(steps), adamw)
    options: dict[str, Any] = {"delay": method.delay}
    if method.bits:
        options["communication"] = lsgd_jax.comm.quantized(method.bits, two_level=True)
    if method.kind == "diloco":
        options["outer_optimizer"] = outer_optimizer(outer or DILOCO_OUTER)
    period = averaging_period(method.period, steps, final, qsr, warmup)
    averager = lsgd_jax.PeriodicModelAverager(period, warmup_steps=start, **options)
    means = lsgd_jax.comm.quantized(warmup_bits, two_level=True) if warmup_bits else None
    hook = lsgd_jax.post_local_sgd(start, communication=means)
    return optax.chain(hook, adamw, lsgd_jax.model_averaging(averager))


def averaging_period(
    period: int,
    steps: int,
    final: tuple[int, int] | None,
    qsr: float = 0.0,
    warmup: int = 0,
) -> Any:
    """The averager's period: ``period``, or with ``final=(final_period, final_steps)``
    a schedule that averages every ``final_period`` steps over the run's last
    ``final_steps`` (``jnp.where(step < steps - final_steps, period, final_period)``).

    ``qsr`` (> 0): the quadratic synchronization rule (Gu et al., ICLR 2024): the period
    grows as the inner learning rate ``lr(step)`` decays, ``max(period, qsr / r**2)``
    with ``r = lr(step) / peak`` (this script's warm-up and cosine, ``warmup`` steps),
    and the run's last step averages (so the model evaluated is an average the ledger
    counted, not a free one)."""
    if qsr:
        shape = optax.warmup_cosine_decay_schedule(0.0, 1.0, warmup, max(steps, warmup + 1))

        def quadratic(step: Any) -> Any:
            r2 = jnp.maximum(jnp.square(shape(step)), 1e-12)
            grown = jnp.clip(jnp.floor(qsr / r2), period, 2**30).astype(jnp.int32)
            return jnp.where(step >= steps - 1, 1, grown)

        return quadratic
    if not final or not final[1]:
        return period
    final_period, final_steps = final
    return lambda step: jnp.where(step < steps - final_steps, period, final_period)


def final_of_args(args: Any) -> tuple[int, int] | None:
    """``--final-period --final-steps`` as :func:`make_tx`'s ``final`` (None: unset)."""
    return (args.final_period, args.final_steps) if args.final_steps else None


def tx_of_args(method: Method, args: Any, outer: dict[str, Any] | None) -> Any:
    """:func:`make_tx` from the command line's ``--steps --start --lr --warmup
    --warmup-bits --final-period --final-steps`` (this script's and
    benchmarks/lm_link.py's)."""
    return make_tx(
        method,
        steps=args.steps,
        start=args.start,
        lr=args.lr,
        warmup=args.warmup,
        outer=outer,
        warmup_bits=args.warmup_bits,
        final=final_of_args(args),
        qsr=args.qsr,
    )


# ----------------------------------------------------------------------------- training


def cross_node_messages(ledger: Any) -> np.ndarray:
    """Cross-node collectives of each step (each pays the link's latency once)."""
    per_program = {
        k: sum(1 for c in v.report if c.axes is None or set(c.axes) - set(ledger.inner_axes))
        for k, v in ledger.phases.items()
    }
    return np.array([per_program[k] for k in ledger.steps], np.int64)


def emulated_seconds(
    compute: float,
    wire_bytes: np.ndarray,
    messages: np.ndarray,
    link_mbit: float,
    latency_ms: float,
) -> np.ndarray:
    """Emulated time after each step: ``s * compute + 8 * W(s) / rate + M(s) * latency``
    (cumulative wire bytes ``W`` and messages ``M`` of one device)."""
    steps = np.arange(1, len(wire_bytes) + 1)
    link = 8.0 * np.cumsum(wire_bytes) / (link_mbit * 1e6)
    return steps * compute + link + np.cumsum(messages) * latency_ms / 1e3


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every run of one process shares: mesh, data, model sizes, hyperparameters."""

    mesh: Any
    corpus: Corpus
    model: ModelConfig
    args: argparse.Namespace


def outer_of_args(args: argparse.Namespace, method: Method) -> dict[str, Any]:
    """:func:`outer_options` from ``--outer-lr --outer-momentum --outer-decay
    --outer-floor --outer-cooldown`` (this script's and benchmarks/lm_link.py's)."""
    scheduled = (args.outer_decay or args.outer_cooldown) and method.kind == "diloco"
    period = averaging_period(method.period, args.steps, final_of_args(args), args.qsr, args.warmup)
    decay = (args.steps, args.start, period) if scheduled else None
    return outer_options(
        args.outer_lr,
        args.outer_momentum,
        decay,
        floor=args.outer_floor,
        cooldown=args.outer_cooldown,
    )


def train(method: Method, setup: Setup, progress: bool = True) -> dict[str, Any]:
    """Trains one method; returns its record (histories included)."""
    a, cfg = setup.args, setup.model
    outer = outer_of_args(a, method)
    tx = tx_of_args(method, a, outer)
    graphdef, params0 = init_model(cfg, a.seed)
    step = lsgd_jax.data_parallel_step(make_loss_fn(graphdef), tx, setup.mesh)
    params = lsgd_jax.replicate(params0, setup.mesh)
    opt_state = lsgd_jax.replicate(tx.init(params0), setup.mesh)
    data = batches(setup.corpus.train, a.global_batch, cfg.context, a.seed)
    first = next(batches(setup.corpus.train, a.global_batch, cfg.context, a.seed))
    ledger = lsgd_jax.communication_ledger(step, params, opt_state, first, num_steps=a.steps)
    val = jnp.asarray(validation_windows(setup.corpus.val, a.val_windows, cfg.context))
    val_loss = lambda p: float(evaluate(graphdef, lsgd_jax.consensus(p), val))  # noqa: E731
    evals, losses, seconds = [(0, val_loss(params))], [], []
    across = np.cumsum(ledger.per_step("across"))
    link = np.cumsum(ledger.link_per_step())
    for s in tqdm(range(a.steps), desc=method.name, disable=not progress):
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, next(data))
        losses.append(float(loss))  # waits for the step
        seconds.append(time.perf_counter() - t0)
        if (s + 1) % a.eval_every == 0 or s + 1 == a.steps:
            evals.append((s + 1, val_loss(params)))
            if a.json:  # as it goes: a run cut short keeps its evaluations
                write_progress(
                    a.json, method.name, s + 1, evals[-1][1], int(across[s]), int(link[s])
                )
    return make_record(method, ledger, losses, seconds, evals, a, params0)


def write_progress(
    path: str, method: str, step: int, val_loss: float, across: int, link: int = 0
) -> None:
    """Appends one evaluation to ``<path>.progress.jsonl`` (a line of JSON: the method,
    the step, the validation loss, the cross-node bytes per device so far and the bytes
    on the node links so far, every device together)."""
    line = {"method": method, "step": step, "val_loss": val_loss, "cross_node_bytes": across,
            "node_link_bytes": link}  # fmt: skip
    with open(f"{path}.progress.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def make_record(
    method: Method,
    ledger: Any,
    losses: list[float],
    seconds: list[float],
    evals: list[tuple[int, float]],
    a: argparse.Namespace,
    params0: Any,
) -> dict[str, Any]:
    """The run's record: final numbers, per-step and per-evaluation histories."""
    across, link = np.cumsum(ledger.per_step("across")), np.cumsum(ledger.link_per_step())
    wire, messages = ledger.per_step("across", wire=True), cross_node_messages(ledger)
    compute = a.compute_ms / 1e3 if a.compute_ms else statistics.median(seconds)
    emulated = emulated_seconds(compute, wire, messages, a.link_mbit, a.latency_ms)
    eval_step = [s for s, _ in evals]
    at = lambda series, s: float(series[s - 1]) if s else 0.0  # noqa: E731
    return {
        "method": method.name,
        "params": sum(int(x.size) for x in jax.tree.leaves(params0)),
        "steps": a.steps,
        "start": a.start,
        "programs": len(ledger.phases),  # one compiled step program per phase
        "val_loss": evals[-1][1],
        "train_loss": losses[-1],
        "cross_node_bytes": int(across[-1]),
        # every device together, as the nodes' network interfaces count them (a flat
        # ring crosses nodes at a few hops; a two-level exchange sends every share)
        "node_link_bytes": ledger.link_total(),
        "compute_s_per_step": compute,
        "peak_device_bytes": peak_device_bytes(),
        "emulated_s": float(emulated[-1]),
        "link_mbit": a.link_mbit,
        "latency_ms": a.latency_ms,
        "history": {
            "loss": losses,
            "cross_node_bytes": across.tolist(),
            "eval_step": eval_step,
            "val_loss": [v for _, v in evals],
            "eval_cross_node_bytes": [int(at(across, s)) for s in eval_step],
            "eval_node_link_bytes": [int(at(link, s)) for s in eval_step],
            "eval_emulated_s": [at(emulated, s) for s in eval_step],
        },
    }


# ----------------------------------------------------------------------------- output


def plot(records: list[dict], path: str) -> None:
    """Validation loss against cross-node bytes and against emulated time, one line a run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for r in records:
        h = r["history"]
        left.plot(
            np.array(h["eval_cross_node_bytes"]) / 1e6, h["val_loss"], "o-", ms=3, label=r["method"]
        )
        right.plot(h["eval_emulated_s"], h["val_loss"], "o-", ms=3, label=r["method"])
    left.set_xlabel("cross-node MB per device")
    left.set_ylabel("validation loss (nats/byte)")
    rate = f"{records[0]['link_mbit']:g} Mbit/s, {records[0]['latency_ms']:g} ms"
    right.set_xlabel(f"emulated time (s), {rate}")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"byte-level LM, {records[0]['params']:,} params, 2 nodes x 4 devices")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary_line(record: dict) -> str:
    """One JSON line: the run's final numbers (no histories)."""
    return json.dumps({k: v for k, v in record.items() if k != "history"})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (``--recipe`` first sets a recipe's flags, ``--quick`` then the CI
    sizes; later flags override both)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, for CI: " + " ".join(QUICK))
    p.add_argument(
        "--recipe",
        default="",
        choices=["", *RECIPES],
        help="a named recipe's flags first (later flags override): "
        + "; ".join(f"{k}: {' '.join(v)}" for k, v in RECIPES.items()),
    )
    p.add_argument("--method", default="ddp", help="ddp, local or diloco (or localH, dilocoH)")
    p.add_argument("--compare", default="", help="several runs, e.g. ddp,local8,local32,diloco")
    p.add_argument("--period", type=int, default=0, help="H (default 8; diloco 32)")
    p.add_argument("--bits", type=int, default=0, help="4 or 8: quantized two-level averages")
    p.add_argument("--delay", type=int, default=0, help="global averages land D steps later")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--start", type=int, default=100, help="start_localSGD_iter (= warm-up)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--outer-lr", type=float, default=DILOCO_OUTER["learning_rate"], help="diloco's outer step"
    )
    p.add_argument(
        "--outer-momentum", type=float, default=DILOCO_OUTER["momentum"], help="its momentum"
    )
    p.add_argument(
        "--outer-decay",
        action="store_true",
        help="diloco's outer learning rate decays to 0 over its outer steps (cosine)",
    )
    p.add_argument(
        "--outer-floor",
        type=float,
        default=0.0,
        help="with --outer-decay: the cosine ends at this fraction of --outer-lr",
    )
    p.add_argument(
        "--outer-cooldown",
        type=float,
        default=0.0,
        help="instead of --outer-decay: over this last fraction of the outer steps the outer"
        " step turns linearly into a plain average (learning rate 1, no momentum)",
    )
    p.add_argument(
        "--final-period",
        type=int,
        default=8,
        help="with --final-steps: the period of the averages over the run's last steps",
    )
    p.add_argument(
        "--final-steps", type=int, default=0, help="the run's last steps at --final-period"
    )
    p.add_argument(
        "--qsr",
        type=float,
        default=0.0,
        help="the period grows as the learning rate decays: max(H, QSR / (lr/peak)**2),"
        " and the last step averages (quadratic synchronization rule)",
    )
    p.add_argument("--warmup", type=int, default=50, help="learning-rate warm-up steps")
    p.add_argument(
        "--warmup-bits",
        type=int,
        default=0,
        choices=[0, 4, 8],
        help="the gradient means before the switch quantized (not DDP's), with error feedback",
    )
    p.add_argument("--global-batch", type=int, default=32, help="sequences, over 8 replicas")
    for name, default in dataclasses.asdict(ModelConfig()).items():
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--max-mb", type=float, default=4.0, help="training text, MB")
    p.add_argument("--val-windows", type=int, default=64, help="held-out windows per eval")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--link-mbit", type=float, default=100.0)
    p.add_argument("--latency-ms", type=float, default=1.0)
    p.add_argument(
        "--compute-ms", type=float, default=0.0, help="step compute time (default: measured)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default="", help="write the comparison plot here (png)")
    p.add_argument("--json", default="", help="write the records (with histories) here")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    p.add_argument("--platform", default="cpu", choices=["cpu", "gpu"], help="gpu: JAX's GPUs")
    p.add_argument("--mesh", default="2x4", help="nodes x devices per node, e.g. 2x4 or 1x1")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    if args.quick or args.recipe:  # the recipe, then the CI sizes, then the given flags
        args = p.parse_args(RECIPES.get(args.recipe, []) + (QUICK if args.quick else []) + argv)
    nodes, _, per_node = args.mesh.partition("x")
    if not (nodes.isdigit() and per_node.isdigit() and int(nodes) * int(per_node) > 0):
        p.error(f"--mesh must be NODESxDEVICES, e.g. 2x4, got {args.mesh!r}")
    args.nodes, args.per_node = int(nodes), int(per_node)
    if args.global_batch % (args.nodes * args.per_node):
        p.error(f"--global-batch must be a multiple of the {args.nodes * args.per_node} replicas")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    """Trains the requested runs; prints a JSON line for each and returns the records."""
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    setup_cpu_devices(args.nodes * args.per_node, args.platform)
    lsgd_jax.use_compilation_cache()  # a rerun loads its programs instead of compiling
    specs = args.compare.split(",") if args.compare else [args.method]
    methods = [parse_method(s, args.period, args.bits, args.delay) for s in specs]
    model = ModelConfig(args.layers, args.width, args.heads, args.context)
    mesh = lsgd_jax.make_mesh(num_nodes=args.nodes, devices_per_node=args.per_node)
    setup = Setup(mesh, load_corpus(args.max_mb), model, args)
    records = [train(m, setup, progress=not args.no_progress) for m in methods]
    for r in records:
        print(summary_line(r))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(records, indent=1))
    if args.plot:
        plot(records, args.plot)
    return records


if __name__ == "__main__":
    main()
