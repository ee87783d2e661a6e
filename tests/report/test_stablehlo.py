"""The StableHLO report walks the module object: the same report as reading its text."""

import logging
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import DATA, linear_loss, mesh_2x4, put, smap

import lsgd_jax
from lsgd_jax import comm
from lsgd_jax._core import _compat
from lsgd_jax.report._records import Collective, CommunicationReport, _axes_of, _operand_bytes
from lsgd_jax.report._stablehlo import _Site, _StableHLOWalk, parse_stablehlo


def periodic(**options):
    return lsgd_jax.PeriodicModelAverager(2, warmup_steps=10, **options)


# (name, averager): flat, two-level, quantized (one and two levels, 4 bits), compressed
# with delta, hierarchical, delayed, finite-only.
AVERAGERS = [
    ("flat", periodic()),
    ("two_level", periodic(communication=comm.two_level())),
    ("quantized", periodic(communication=comm.quantized(8))),
    ("quantized_two_level_4bit", periodic(communication=comm.quantized(4, two_level=True))),
    ("bf16_delta", periodic(communication_dtype=jnp.bfloat16, delta=True)),
    (
        "hierarchical",
        lsgd_jax.HierarchicalModelAverager({2: "local", 4: ("node", "local")}, warmup_steps=10),
    ),
    ("delay", lsgd_jax.PeriodicModelAverager(4, warmup_steps=10, delay=1)),
    ("finite_only", periodic(communication=comm.finite_only("skip"))),
]


def exported_step(averager):
    """A data_parallel_step (post-local SGD hook, SGD, the averager) lowered for CUDA."""
    mesh = mesh_2x4()
    tx = optax.chain(
        lsgd_jax.post_local_sgd(10), optax.sgd(0.1), lsgd_jax.model_averaging(averager)
    )
    step = lsgd_jax.data_parallel_step(linear_loss, tx, mesh)
    params = {"w": jnp.ones((16, 8)), "b": jnp.zeros(8)}
    args = (
        lsgd_jax.replicate(params, mesh),
        lsgd_jax.replicate(tx.init(params), mesh),
        put(jnp.ones((32, 16)), mesh, DATA),
    )
    exported = jax.export.export(step.jitted, platforms=("cuda",))(*step.jit_args(*args))
    return exported, mesh


@pytest.mark.filterwarnings("ignore:HierarchicalModelAverager averages over")
@pytest.mark.parametrize("name, averager", AVERAGERS, ids=[n for n, _ in AVERAGERS])
def test_the_walk_gives_the_report_the_text_gave(name, averager, caplog):
    # finite_only logs a non-finite mean through a host callback, which jax.export
    # cannot lower for another platform; with the logger quiet the program holds none.
    caplog.set_level(logging.ERROR, logger="lsgd_jax")
    exported, mesh = exported_step(averager)
    walked = parse_stablehlo(_compat.stablehlo_module(exported), mesh=mesh)
    read = text_report(exported.mlir_module(), mesh=mesh)
    assert len(walked) > 0
    assert walked == read  # every field of every collective, in the same order
    assert any(c.conditional for c in walked) and any(c.branch is not None for c in walked)
    # the branch a collective's op_name names is the region of the outermost case
    walk = _StableHLOWalk(_compat.stablehlo_module(exported), mesh)
    walk.regions(walk.entry(), _Site())
    assert walk.branches == [c.branch for c in walked]
    # the text form of the module, parsed by MLIR, walks the same
    assert parse_stablehlo(exported.mlir_module(), mesh=mesh) == walked


HANDWRITTEN = """func.func @main(%p: tensor<i32>, %x: tensor<8xf32>, %y: tensor<2xf32>)
    -> (tensor<8xf32>, tensor<2xf32>) {
  %0:2 = "stablehlo.all_reduce"(%x, %y) <{channel_handle = #stablehlo.channel_handle<handle = 1,
      type = 1>, replica_groups = dense<[[0, 1, 2, 3, 4, 5, 6, 7]]> : tensor<1x8xi64>,
      use_global_device_ids}> ({
  ^bb0(%a: tensor<f32>, %b: tensor<f32>):
    %s = stablehlo.add %a, %b : tensor<f32>
    stablehlo.return %s : tensor<f32>
  }) : (tensor<8xf32>, tensor<2xf32>) -> (tensor<8xf32>, tensor<2xf32>) loc("metrics/psum")
  %1 = "stablehlo.case"(%p) ({
    %2 = "stablehlo.reduce_scatter"(%x) <{replica_groups = dense<[[0, 4], [1, 5], [2, 6],
        [3, 7]]> : tensor<4x2xi64>, scatter_dimension = 0 : i64}> ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %s = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }) : (tensor<8xf32>) -> tensor<4xf32> loc(callsite("cond/branch_0_fun/psum_scatter"
        at "f.py":3:4))
    %3 = "stablehlo.all_gather"(%2) <{all_gather_dim = 0 : i64, replica_groups =
        dense<[[0, 4], [1, 5], [2, 6], [3, 7]]> : tensor<4x2xi64>}>
        : (tensor<4xf32>) -> tensor<8xf32> loc("cond/branch_0_fun/all_gather"("f.py":3:9))
    stablehlo.return %3 : tensor<8xf32>
  }, {
    %4 = "stablehlo.collective_broadcast"(%x) <{replica_groups = dense<[[0, 1], [2, 3],
        [4, 5], [6, 7]]> : tensor<4x2xi64>}> : (tensor<8xf32>) -> tensor<8xf32>
    stablehlo.return %4 : tensor<8xf32>
  }) : (tensor<i32>) -> tensor<8xf32>
  return %1, %0#1 : tensor<8xf32>, tensor<2xf32>
}"""


def test_a_handwritten_module_walks_as_its_text_read():
    # Several results, reduce-scatter, broadcast, a call-site location, and both
    # branches of a case; the printed module (what jax.export's text is) reads the same.
    # (SSA names are the printed ones: MLIR numbers sibling regions from the same start.)
    mesh = mesh_2x4()
    module = _compat.stablehlo_module(HANDWRITTEN)
    walked = parse_stablehlo(module, mesh=mesh)
    assert walked == text_report(module.operation.get_asm(enable_debug_info=True), mesh=mesh)
    got = [(c.kind, c.name, c.bytes, c.axes, c.conditional, c.branch, c.scope) for c in walked]
    assert got == [
        ("all-reduce", "%0:2", 40, ("node", "local"), False, None, "metrics"),
        ("reduce-scatter", "%2", 32, ("node",), True, 0, ""),
        ("all-gather", "%3", 16, ("node",), True, 0, ""),
        ("collective-broadcast", "%2", 32, None, True, None, ""),
    ]


def test_a_called_function_is_walked_at_each_call_site():
    # An inner jax.jit becomes a func.call of a private function. The walk follows each
    # call: inside a cond branch its collective is conditional, and the call's name
    # (with the branch) prefixes the op_name; the text parser listed it once, as
    # unconditional, named only "psum".
    mesh = mesh_2x4()
    inner = jax.jit(lambda g: jax.lax.pmean(g, "local"))

    def body(g):
        g = jax.lax.cond(g.sum() > 0, inner, lambda g: jax.lax.pmean(g, ("node", "local")), g)
        return inner(g)

    f = smap(body, mesh, DATA, DATA, check_vma=False)
    x = put(jnp.ones((8, 4)), mesh, DATA)
    report = lsgd_jax.communication_report(f, x, platform="cuda")
    got = sorted((c.axes, c.conditional, c.branch, c.op_name.split("/")[-1]) for c in report)
    assert got == [
        (("local",), False, None, "psum"),
        (("local",), True, 1, "psum"),
        (("node", "local"), True, 0, "psum"),
    ]
    assert all(c.bytes == 16 for c in report)


def test_element_types_count_their_bytes():
    # Types the text parser mis-sized: i4 (taken as 4 bytes), f8 (not read: 0 bytes),
    # complex; a sub-byte element counts one byte, as in parse_hlo.
    types = {"4xi4": 4, "4xf8E4M3FN": 4, "4xcomplex<f32>": 32, "4xui16": 8, "4x2xi1": 8}
    for t, nbytes in types.items():
        mlir = f"""func.func @main(%x: tensor<{t}>) -> tensor<{t}> {{
  %0 = "stablehlo.all_to_all"(%x) <{{concat_dimension = 0 : i64,
      replica_groups = dense<[[0, 1, 2, 3], [4, 5, 6, 7]]> : tensor<2x4xi64>,
      split_count = 4 : i64, split_dimension = 0 : i64}}> : (tensor<{t}>) -> tensor<{t}>
  return %0 : tensor<{t}>
}}"""
        (c,) = parse_stablehlo(mlir, mesh=mesh_2x4())
        assert (c.kind, c.bytes, c.axes, c.conditional, c.name) == (
            "all-to-all",
            nbytes,
            ("local",),
            False,
            "%0",
        ), t


def test_permute_pairs():
    mlir = """func.func @main(%x: tensor<2xf32>) -> (tensor<2xf32>, tensor<6xf32>) {
  %0 = "stablehlo.collective_permute"(%x) <{source_target_pairs =
      dense<[[0, 1], [1, 2], [2, 0]]> : tensor<3x2xi64>}> : (tensor<2xf32>) -> tensor<2xf32>
  %1 = "stablehlo.all_gather"(%x) <{all_gather_dim = 0 : i64,
      replica_groups = dense<[[0, 1, 2], [3, 4, 5]]> : tensor<2x3xi64>}>
      : (tensor<2xf32>) -> tensor<6xf32>
  return %0, %1 : tensor<2xf32>, tensor<6xf32>
}"""
    permute, gather = parse_stablehlo(mlir)
    assert (permute.group_size, permute.num_groups, permute.bytes) == (2, 3, 8)
    assert permute.replica_groups == ((0, 1), (1, 2), (2, 0)) and permute.axes is None
    assert gather.replica_groups == ((0, 1, 2), (3, 4, 5)) and gather.bytes == 8


def test_lowered_module_object_walks_like_the_exported_one():
    # lowered.compiler_ir("stablehlo") is already a module object: no text in between.
    mesh = mesh_2x4()
    f = smap(lambda g: jax.lax.pmean(g, "local"), mesh, DATA, DATA)
    x = put(jnp.ones((8, 4)), mesh, DATA)
    module = f.trace(x).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
    (c,) = parse_stablehlo(module, mesh=mesh)
    assert (c.kind, c.axes, c.bytes, c.conditional, c.scope) == (
        "all-reduce",
        ("local",),
        16,
        False,
        "",
    )
    assert c.op_name.endswith("pmean") or "psum" in c.op_name


def test_no_main_function_is_an_error():
    mlir = "func.func private @f() { return }"
    with pytest.raises(ValueError, match="no main function"):
        parse_stablehlo(mlir)


# The regex-based StableHLO text parser that parse_stablehlo replaced, kept as the
# independent reference of test_the_walk_gives_the_report_the_text_gave.
_MLIR_KINDS = {
    "all_reduce": "all-reduce",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "collective_permute": "collective-permute",
    "all_to_all": "all-to-all",
    "collective_broadcast": "collective-broadcast",
}
_MLIR_OP = re.compile(r'"stablehlo\.(' + "|".join(_MLIR_KINDS) + r')"')
_MLIR_COND = re.compile(r'"stablehlo\.(case|if)"\(')
_MLIR_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-z]+\d*)>")
_MLIR_BYTES = {
    "i1": 1,
    "i8": 1,
    "ui8": 1,
    "i16": 2,
    "bf16": 2,
    "f16": 2,
    "i32": 4,
    "ui32": 4,
    "f32": 4,
    "i64": 8,
    "ui64": 8,
    "f64": 8,
}


def _mlir_bytes(types: str) -> int:
    total = 0
    for dims, dtype in _MLIR_TENSOR.findall(types):
        n = int(np.prod([int(d) for d in dims.split("x") if d] or [1]))
        total += n * _MLIR_BYTES.get(dtype, 4)
    return total


_MLIR_LOC_ALIAS = re.compile(r"^(#loc\d*)\s*=\s*loc\((.*)\)\s*$")


def _mlir_loc_name(loc: str, aliases: dict[str, str], depth: int = 0) -> str:
    """The JAX name of an MLIR location: ``"name"(...)``, through ``#loc`` aliases and
    ``callsite(callee at caller)``; "" for file or unknown locations."""
    loc = loc.strip()
    if depth > 64:
        return ""
    if loc.startswith("#loc"):
        return _mlir_loc_name(aliases.get(loc, ""), aliases, depth + 1)
    name = re.match(r'"((?:[^"\\]|\\.)*)"(?!:\d)', loc)  # a name, not "file":line:col
    if name:
        return name.group(1)
    callee = re.match(r"callsite\((#loc\d*|\S+)\s+at\b", loc)
    if callee:
        return _mlir_loc_name(callee.group(1), aliases, depth + 1)
    return ""


def text_report(text: str, mesh: Any = None) -> CommunicationReport:
    """The report the regex-based text parser gave (lsgd_jax before issue 17): the
    reference the module walk is compared with."""
    lines = text.splitlines()
    locs = {m[1]: m[2] for m in map(_MLIR_LOC_ALIAS.match, lines) if m}
    stack: list[int] = []  # indents of the open case/if ops
    out = []
    for k, line in enumerate(lines):
        indent = len(line) - len(line.lstrip())
        stripped = line.strip()
        if stack and indent == stack[-1] and stripped.startswith("})"):
            stack.pop()
            continue
        if _MLIR_COND.search(line):
            stack.append(indent)
            continue
        m = _MLIR_OP.search(line)
        if not m:
            continue
        groups_m = re.search(r"replica_groups = dense<(\[\[.*?\]\])>", line)
        if groups_m:
            groups = tuple(
                tuple(int(i) for i in g.split(",") if i.strip())
                for g in re.findall(r"\[([\d,\s]+)\]", groups_m.group(1))
            )
        else:
            groups = ((),)
        # An op with a region (all_reduce's reducer) ends at its "})" line, with the
        # types and location there; one without (all_to_all, all_gather) on its own line.
        close = line
        if line.rstrip().endswith("({"):
            close = next(
                (
                    later
                    for later in lines[k + 1 :]
                    if later.strip().startswith("})") and len(later) - len(later.lstrip()) == indent
                ),
                line,
            )
        result_types = close.split("->", 1)[-1] if "->" in close else ""
        op = re.search(r"\bloc\((.*)\)\s*$", close)
        size = max(len(g) for g in groups) or 1
        out.append(
            Collective(
                kind=_MLIR_KINDS[m.group(1)],
                group_size=size,
                num_groups=len(groups),
                axes=_axes_of(groups, mesh) if groups != ((),) else None,
                bytes=_operand_bytes(_MLIR_KINDS[m.group(1)], _mlir_bytes(result_types), size),
                conditional=bool(stack),
                name=stripped.split("=", 1)[0].strip(),
                computation="",
                op_name=_mlir_loc_name(op.group(1), locs) if op else "",
                replica_groups=groups,
            )
        )
    return CommunicationReport(out)
