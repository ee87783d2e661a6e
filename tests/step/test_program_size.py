"""A phase's program carries its phase's math and nothing per leaf beyond it: read from
the compiled module, not timed (issue 27)."""

import collections
import importlib.util
import pathlib
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import DATA, mesh_2x4
from jax.sharding import NamedSharding

import lsgd_jax

WIDTH = 8
_SPEC = importlib.util.spec_from_file_location(
    "compile_time", pathlib.Path(__file__).parents[2] / "benchmarks" / "compile_time.py"
)
COMPILE_TIME = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(COMPILE_TIME)  # the hand-written step the benchmarks measure


def mlp(layers):
    params = {f"l{i:03d}": {"w": jnp.eye(WIDTH), "b": jnp.zeros(WIDTH)} for i in range(layers)}

    def loss_fn(p, x):
        for k in sorted(p):
            x = jnp.tanh(x @ p[k]["w"] + p[k]["b"])
        return jnp.mean(x**2)

    return params, loss_fn


def ops(text):
    """How many instructions of each opcode a compiled HLO module holds, and (as
    ``"kernels"``) how many distinct fused computations: XLA compiles one kernel per
    distinct fusion and reuses it for identical ones, so this is what compile time grows
    with (a per-leaf kernel that differs from leaf to leaf costs ~25 ms each on CPU)."""
    counts = collections.Counter(re.findall(r"=\s*[a-z0-9\[\],{}: ]*?\s([a-z\-]+)\(", text))
    counts["kernels"] = len(kernels(text))
    return counts


def kernels(text):
    """The distinct fused computations of a compiled HLO module, names and metadata
    removed (two fusions that differ only in their instructions' names are one kernel)."""
    distinct = set()
    for block in re.split(r"\n(?=%?[\w.\-]+ \()", text):
        head, _, body = block.partition("\n")
        if "fused" in head.split(" ")[0] or "wrapped" in head.split(" ")[0]:
            body = re.sub(r", metadata=\{[^}]*\}", "", body)
            signature = re.sub(r"[\w.\-]+: ", "", head.split(" ", 1)[1])  # no names
            distinct.add(re.sub(r"%[\w.\-]+", "%v", signature + body))
    return distinct


def hand_written(params, loss_fn, mesh, batch):
    inner = optax.adamw(1e-3)
    step = COMPILE_TIME.hand_written_step(loss_fn, inner, mesh)
    state = lsgd_jax.replicate(inner.init(params), mesh)
    return ops(step.lower(lsgd_jax.replicate(params, mesh), state, batch).compile().as_text())


def phase_programs(params, loss_fn, mesh, batch, communication=None):
    tx = optax.chain(
        lsgd_jax.post_local_sgd(8, post_local_gradient_allreduce=False),
        optax.adamw(1e-3),
        lsgd_jax.model_averaging(
            lsgd_jax.PeriodicModelAverager(4, warmup_steps=8, communication=communication)
        ),
    )
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh)
    p, s = lsgd_jax.replicate(params, mesh), lsgd_jax.replicate(tx.init(params), mesh)
    return {k: ops(c.as_text()) for k, c in step.programs_of(p, s, batch, num_steps=16)}


COUNTER_OPS = ("compare", "remainder", "and", "sign", "shift-right-logical", "negate")


@pytest.mark.parametrize("communication", [None])
def test_the_phase_guard_is_computed_once_not_once_per_leaf(communication):
    # The phase guard's counter arithmetic was copied into each state leaf's fusion:
    # 1,770 compares and 1,768 selects in a 64-leaf program against the hand-written
    # step's 1 and 1 (the HLO 2.4x as large).
    mesh = mesh_2x4()
    batch = jax.device_put(jnp.ones((16, WIDTH)), NamedSharding(mesh, DATA))
    strategy = lsgd_jax.comm.quantized(4, two_level=True) if communication else None
    counts = {}
    for layers in (4, 16):
        params, loss_fn = mlp(layers)
        hand = hand_written(params, loss_fn, mesh, batch)
        programs = phase_programs(params, loss_fn, mesh, batch, strategy)
        assert sorted(programs) == [0, 1, 2]
        counts[layers] = {
            k: {op: c[op] - hand[op] for op in COUNTER_OPS} for k, c in programs.items()
        }
        leaves = len(jax.tree.leaves(params))
        for k, c in programs.items():
            # the guard's one select per state leaf (params, two Adam moments), no more
            assert c["select"] - hand["select"] <= 3 * leaves + 16, (k, c["select"])
    assert counts[4] == counts[16]  # the excess does not grow with the leaves


@pytest.mark.parametrize("communication", ["float32", "int8", "4-bit no EF"])
def test_distinct_kernels_do_not_grow_with_the_leaves(communication):
    # XLA compiles each distinct fusion once: a program whose kernels differ from leaf
    # to leaf compiles in time proportional to the leaves (the quantized mean's pieces,
    # sliced at constant offsets: 3.4x the float32 average's compile at 128 leaves).
    mesh = mesh_2x4()
    batch = jax.device_put(jnp.ones((16, WIDTH)), NamedSharding(mesh, DATA))
    strategy = {
        "float32": None,
        "int8": lsgd_jax.comm.quantized(8, two_level=True),
        "4-bit no EF": lsgd_jax.comm.quantized(4, error_feedback=False),
    }[communication]
    distinct = {}
    for layers in (4, 16):
        params, loss_fn = mlp(layers)
        hand = hand_written(params, loss_fn, mesh, batch)["kernels"]
        programs = phase_programs(params, loss_fn, mesh, batch, strategy)
        distinct[layers] = {k: c["kernels"] for k, c in programs.items()}
        for k in (0, 2):  # the DDP and local phases: the hand-written step's kernels
            assert distinct[layers][k] <= hand + 4, (layers, k, distinct[layers][k], hand)
    # 24 leaves more: a kernel per leaf would add 24 (before: the average 58 -> 214)
    for k in distinct[4]:
        assert distinct[16][k] <= distinct[4][k] + 8, distinct
