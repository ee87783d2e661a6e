"""communication_report: what a compiled step communicates, read off its HLO."""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from jaxlib.mlir import ir

from lsgd_jax._core import _compat

_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
    "collective-broadcast",
    "ragged-all-to-all",
)
_DTYPE_BYTES = {
    "pred": 1,
    "s2": 1,
    "u2": 1,
    "s4": 1,
    "u4": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_COMP_START = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s+=\s+(.*)$")
_SHAPE = re.compile(r"([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_CALLEES = re.compile(
    r"\b(to_apply|calls|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"\b(branch_computations|called_computations)=\{([^}]*)\}")


SCOPES = (
    "post_localSGD_hook",
    "ddp",
    "model_averaging",
    "model_state_averaging",
    "metrics",
    "common_anchor",
)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective operation of a compiled program.

    Attributes:
      kind: the HLO collective, e.g. ``"all-reduce"`` (async ``-start`` forms folded in).
      group_size: replicas in each of its groups.
      num_groups: how many groups run it side by side.
      axes: the mesh axes whose replicas form the groups, when a mesh is known and they
        match one; else None.
      bytes: bytes each device sends into it (its operands).
      conditional: True when it sits inside a ``conditional`` branch (runs only on the
        steps that take that branch); False when it runs on every call.
      name: the instruction's name in the HLO.
      computation: the HLO computation that holds it.
      op_name: the JAX-level name from the instruction's metadata.
      replica_groups: the groups, as tuples of device positions in the mesh.
    """

    kind: str
    group_size: int
    num_groups: int
    axes: tuple[str, ...] | None
    bytes: int
    conditional: bool
    name: str
    computation: str
    op_name: str
    replica_groups: tuple[tuple[int, ...], ...]

    @property
    def scope(self) -> str:
        """Which part of lsgd_jax made it (``"post_localSGD_hook"``, ``"ddp"``,
        ``"model_averaging"``, ``"model_state_averaging"``, ``"metrics"``), "" for other
        code; ``"a+b"`` when XLA combined collectives of both into one."""
        parts = set(re.split(r"[/:()]", self.op_name))
        return "+".join(s for s in SCOPES if s in parts)

    @property
    def wire_bytes(self) -> int:
        """Bytes each device sends over links, for the usual algorithms (an estimate).

        Ring all-reduce ``2 (g - 1) / g x bytes``; all-gather ``(g - 1) x bytes``;
        reduce-scatter and all-to-all ``(g - 1) / g x bytes``; permute ``bytes``, for a
        group of ``g``. Unlike ``bytes`` (what goes in), this compares collectives of
        different kinds, e.g. a float32 all-reduce with a bfloat16 all-to-all + all-gather.
        """
        g = max(self.group_size, 1)
        factor = {
            "all-reduce": 2 * (g - 1) / g,
            "all-gather": g - 1,
            "reduce-scatter": (g - 1) / g,
            "all-to-all": (g - 1) / g,
            "ragged-all-to-all": (g - 1) / g,
        }.get(self.kind, 1.0)
        return round(self.bytes * factor)

    @property
    def branch(self) -> int | None:
        """The branch of the outermost ``lax.cond``/``lax.switch`` that holds it, or None.

        For a step from ``data_parallel_step`` that is its phase (see its ``specialize``).
        """
        m = re.search(r"/branch_(\d+)_fun/", self.op_name)
        return int(m.group(1)) if m else None


class CommunicationReport(tuple):
    """The collectives of one compiled program: a tuple of :class:`Collective`.

    ``str(report)`` is a readable table; ``report.where(...)`` filters it.

    Example:
      >>> from lsgd_jax import Collective
      >>> from lsgd_jax import CommunicationReport
      >>> c = Collective("all-reduce", 8, 1, ("node", "local"), 4096, True, "ar", "f", "", ())
      >>> print(CommunicationReport([c]))
      kind        axes        group  groups  bytes  wire bytes  conditional  scope
      ----------  ----------  -----  ------  -----  ----------  -----------  -----
      all-reduce  node,local  8      1       4,096  7,168       yes
    """

    def __str__(self) -> str:
        head = ("kind", "axes", "group", "groups", "bytes", "wire bytes", "conditional", "scope")
        rows = [head] + [
            (
                c.kind,
                ",".join(c.axes) if c.axes is not None else "?",
                str(c.group_size),
                str(c.num_groups),
                f"{c.bytes:,}",
                f"{c.wire_bytes:,}",
                "yes" if c.conditional else "no",
                c.scope or c.op_name[-40:],
            )
            for c in self
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def where(self, **fields: Any) -> CommunicationReport:
        """The collectives whose fields equal the given values, e.g. ``axes=("local",)``.

        Args:
          **fields: Collective field names and values to match.

        Returns:
          A CommunicationReport.

        Example:
          >>> from lsgd_jax.report._report import Collective, CommunicationReport
          >>> c = Collective("all-reduce", 2, 1, ("local",), 8, True, "ar", "f", "", ((0, 1),))
          >>> len(CommunicationReport([c]).where(conditional=False))
          0
        """

        def keep(c: Collective) -> bool:
            return all(getattr(c, k) == v for k, v in fields.items())

        return CommunicationReport(c for c in self if keep(c))


def _type_bytes(type_str: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(type_str):
        size = _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else None)
        if size is None:
            continue
        total += size * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def _operand_bytes(kind: str, result_bytes: int, group_size: int) -> int:
    """The bytes one device puts into a collective, from the bytes of its result."""
    if kind == "all-gather":
        return result_bytes // group_size
    if kind == "reduce-scatter":
        return result_bytes * group_size
    return result_bytes


def _split_type(rhs: str) -> tuple[str, str]:
    """Splits ``'(f32[3], s32[]) all-reduce(...), ...'`` into the type and the rest."""
    if rhs.startswith("("):
        depth = 0
        for i, ch in enumerate(rhs):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rhs[: i + 1], rhs[i + 1 :].lstrip()
    head, _, rest = rhs.partition(" ")
    return head, rest


def _replica_groups(attrs: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        shape = [int(v) for v in m.group(1).split(",")]
        dims = [int(v) for v in m.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(v) for v in m.group(3).split(",")])
        return tuple(tuple(int(i) for i in g) for g in ids.reshape(shape))
    m = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", attrs)
    if m and m.group(1).strip():
        return tuple(
            tuple(int(i) for i in g.split(",") if i.strip())
            for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))
        )
    m = re.search(r"source_target_pairs=\{((?:\{[\d,\s]*\},?\s*)*)\}", attrs)
    if m:
        return tuple(
            tuple(int(i) for i in g.split(",")) for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))
        )
    return (tuple(range(num_devices)),)


def _axes_of(groups: Sequence[Sequence[int]], mesh: Any) -> tuple[str, ...] | None:
    if mesh is None:
        return None
    names = tuple(mesh.axis_names)
    shape = tuple(mesh.devices.shape)
    coords = np.array(list(np.ndindex(*shape)))
    if sum(len(g) for g in groups) != len(coords):
        return None
    want = {frozenset(g) for g in groups}
    for r in range(1, len(names) + 1):
        for subset in itertools.combinations(range(len(names)), r):
            others = [i for i in range(len(names)) if i not in subset]
            parts: dict[tuple[int, ...], set[int]] = {}
            for pos, c in enumerate(coords):
                parts.setdefault(tuple(c[others]), set()).add(pos)
            if {frozenset(p) for p in parts.values()} == want:
                return tuple(names[i] for i in subset)
    return None


# The compiled (post-optimization) program is read from its text: jaxlib's structured
# HloModule (``compiled.runtime_executable().hlo_modules()``) gives each instruction only
# its name, opcode, operands and users (no replica groups, shapes, metadata or called
# computations), and converting it to StableHLO (``_jax.mlir.hlo_to_stablehlo``, private)
# loses the instruction and computation names a Collective carries. Checked with jax 0.10.2.
def parse_hlo(text: str, mesh: Any = None, num_devices: int | None = None) -> CommunicationReport:
    """Lists the collectives of an HLO module's text (``compiled.as_text()``).

    Args:
      text: the HLO text of a compiled program.
      mesh: the mesh its device positions refer to, to name the axes of each group.
      num_devices: devices in the program (for groups written as ``{}``); default the
        mesh's size, or 1.

    Returns:
      A CommunicationReport.

    Example:
      >>> hlo = '''ENTRY %main (p: f32[4]) -> f32[4] {
      ...   %ar = f32[4]{0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
      ... }'''
      >>> [(c.kind, c.bytes, c.conditional) for c in parse_hlo(hlo)]
      [('all-reduce', 16, False)]
    """
    if num_devices is None:
        num_devices = int(mesh.devices.size) if mesh is not None else 1
    comps, entry = _computations(text)
    reached_plain, reached_any = _reached(comps, entry)
    out = []
    for comp, lines in comps.items():
        if comp in reached_any:
            for line in lines:
                c = _collective(line, comp, comp not in reached_plain, mesh, num_devices)
                if c is not None:
                    out.append(c)
    return CommunicationReport(out)


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
    """``({computation: its instruction lines}, the ENTRY computation's name)``."""
    comps: dict[str, list[str]] = {}
    entry = None
    current = None
    for line in text.splitlines():
        m = _COMP_START.match(line)
        if m:
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is not None:
            comps[current].append(line)
    if entry is None:
        raise ValueError("parse_hlo: no ENTRY computation found in the HLO text.")
    return comps, entry


def _reached(comps: dict[str, list[str]], entry: str) -> tuple[set[str], set[str]]:
    """The computations reached from ``entry`` without passing a conditional's branch,
    and all those reached at all."""
    edges: dict[str, list[tuple[str, bool]]] = {c: [] for c in comps}  # (callee, branch?)
    for comp, lines in comps.items():
        for line in lines:
            is_cond = " conditional(" in line
            for key, callee in _CALLEES.findall(line):
                edges[comp].append((callee, key in ("true_computation", "false_computation")))
            for _, callees in _BRANCHES.findall(line):
                for callee in re.findall(r"%?([\w.\-]+)", callees):
                    edges[comp].append((callee, is_cond))
    reached_plain: set[str] = set()
    reached_any: set[str] = set()
    stack = [(entry, False)]
    while stack:
        comp, cond = stack.pop()
        seen = reached_any if cond else reached_plain
        if comp in seen or comp not in comps:
            continue
        seen.add(comp)
        reached_any.add(comp)
        for callee, through in edges[comp]:
            stack.append((callee, cond or through))
    return reached_plain, reached_any


def _collective(
    line: str, comp: str, conditional: bool, mesh: Any, num_devices: int
) -> Collective | None:
    """The collective an HLO instruction line holds, or None."""
    m = _INSTR.match(line)
    if not m:
        return None
    type_str, rest = _split_type(m.group(2))
    opcode = rest.split("(", 1)[0].strip()
    kind = opcode.removesuffix("-start")
    if kind not in _KINDS or opcode.endswith("-done"):
        return None
    groups = _replica_groups(rest, num_devices)
    size = max(len(g) for g in groups)
    nbytes = _type_bytes(type_str)
    if opcode.endswith("-start") and type_str.startswith("(") and kind != "all-reduce":
        nbytes //= 2  # async start returns (operands, results); count the operands
    op = re.search(r'op_name="([^"]*)"', rest)
    return Collective(
        kind=kind,
        group_size=2 if kind == "collective-permute" else size,
        num_groups=len(groups),
        axes=None if kind == "collective-permute" else _axes_of(groups, mesh),
        bytes=_operand_bytes(kind, nbytes, size),
        conditional=conditional,
        name=m.group(1),
        computation=comp,
        op_name=op.group(1) if op else "",
        replica_groups=groups,
    )


# The StableHLO path walks the module object with the MLIR Python bindings that jaxlib
# ships: each operation's name, attributes, result types, location, and the regions and
# called functions that hold it.
_STABLEHLO_KINDS = {
    "stablehlo.all_reduce": "all-reduce",
    "stablehlo.all_gather": "all-gather",
    "stablehlo.reduce_scatter": "reduce-scatter",
    "stablehlo.collective_permute": "collective-permute",
    "stablehlo.all_to_all": "all-to-all",
    "stablehlo.collective_broadcast": "collective-broadcast",
}
_STABLEHLO_CONDITIONALS = ("stablehlo.case", "stablehlo.if")


def _tensor_bytes(type_: Any) -> int:
    """Bytes of a ranked tensor type (a sub-byte element counts one byte, as in HLO); 0
    for a token or a shape not known before run time."""
    if not isinstance(type_, ir.RankedTensorType) or not type_.has_static_shape:
        return 0
    return int(np.prod(type_.shape)) * max(1, _element_bits(type_.element_type) // 8)


def _element_bits(element: Any) -> int:
    if isinstance(element, ir.ComplexType):
        return 2 * _element_bits(element.element_type)
    return int(getattr(element, "width", 32))  # integers and floats have a width


def _loc_name(loc: Any) -> str:
    """The JAX name of an MLIR location: a NameLoc's name, through the callee of call
    sites; "" for file, fused or unknown locations."""
    while isinstance(loc, ir.CallSiteLoc):
        loc = loc.callee
    return str(loc.name_str) if isinstance(loc, ir.NameLoc) else ""


def _stablehlo_groups(op: Any) -> tuple[tuple[int, ...], ...]:
    """``replica_groups`` (or a permute's ``source_target_pairs``); ``((),)`` when empty."""
    attrs = op.attributes
    key = "replica_groups" if "replica_groups" in attrs else "source_target_pairs"
    if key not in attrs:
        return ((),)
    ids = np.array(attrs[key])
    if ids.size == 0:
        return ((),)
    return tuple(tuple(int(i) for i in row) for row in ids.reshape(len(ids), -1))


@dataclasses.dataclass(frozen=True)
class _Site:
    """Where a walk stands: inside a ``case``/``if`` branch or not, the region index of
    the outermost ``case`` around it (None outside any), the names of the ``func.call``
    sites it passed (the prefix of an op_name), the functions it called."""

    conditional: bool = False
    branch: int | None = None
    names: tuple[str, ...] = ()
    calls: tuple[str, ...] = ()


class _StableHLOWalk:
    """One walk over a StableHLO module, from its entry function through every region
    and called function, collecting its collectives."""

    def __init__(self, module: Any, mesh: Any) -> None:
        self.module = module  # its operations live only as long as it does
        body = module.body.operations
        self.funcs = {
            str(op.attributes["sym_name"].value): op.operation
            for op in body
            if op.operation.name == "func.func"
        }
        self.names = ir.AsmState(module.operation)
        self.mesh = mesh
        self.out: list[Collective] = []
        self.branches: list[int | None] = []  # the outermost case's region, per collective

    def entry(self) -> Any:
        """``main``, or the module's only public function."""
        if "main" in self.funcs:
            return self.funcs["main"]
        public = [f for f in self.funcs.values() if _visibility(f) == "public"]
        if len(public) != 1:
            raise ValueError("parse_stablehlo: no main function found in the module.")
        return public[0]

    def regions(self, op: Any, site: _Site) -> None:
        for index, region in enumerate(op.regions):
            if op.name in _STABLEHLO_CONDITIONALS:
                outermost = site.branch is None and op.name == "stablehlo.case"
                branch = index if outermost else site.branch
                here = dataclasses.replace(site, conditional=True, branch=branch)
            else:
                here = site
            for block in region.blocks:
                for inner in block.operations:
                    self.visit(inner.operation, here)

    def visit(self, op: Any, site: _Site) -> None:
        if op.name in _STABLEHLO_KINDS:
            self.out.append(self.collective(op, site))
            self.branches.append(site.branch)
        elif op.name == "func.call":
            self.call(op, site)
        else:
            self.regions(op, site)

    def call(self, op: Any, site: _Site) -> None:
        """Walks the callee at this call site (a recursive call is not walked again)."""
        callee = str(op.attributes["callee"].value)
        if callee in self.funcs and callee not in site.calls:
            names = site.names + (_loc_name(op.location),)
            here = dataclasses.replace(site, names=names, calls=site.calls + (callee,))
            self.regions(self.funcs[callee], here)

    def collective(self, op: Any, site: _Site) -> Collective:
        kind = _STABLEHLO_KINDS[op.name]
        groups = _stablehlo_groups(op)
        size = max(len(g) for g in groups) or 1
        permute = kind == "collective-permute"
        name = op.results[0].get_name(self.names).split("#")[0] if op.results else ""
        return Collective(
            kind=kind,
            group_size=2 if permute else size,
            num_groups=len(groups),
            axes=None if permute or groups == ((),) else _axes_of(groups, self.mesh),
            bytes=_operand_bytes(kind, sum(_tensor_bytes(r.type) for r in op.results), size),
            conditional=site.conditional,
            name=name + (f":{len(op.results)}" if len(op.results) > 1 else ""),
            computation="",
            op_name="/".join(n for n in site.names + (_loc_name(op.location),) if n),
            replica_groups=groups,
        )


def _visibility(func: Any) -> str:
    attrs = func.attributes
    return str(attrs["sym_visibility"].value) if "sym_visibility" in attrs else "public"


def parse_stablehlo(module: Any, mesh: Any = None) -> CommunicationReport:
    """Lists the collectives of a StableHLO module, walking the module object.

    ``module`` is a ``jaxlib.mlir.ir.Module`` (``lowered.compiler_ir("stablehlo")``, or
    ``jax.export``'s ``mlir_module(serialized=False)``) or a module's text (parsed with
    MLIR's own parser). The walk starts at ``main`` and goes through every region, and
    into the function of every ``func.call`` at its call site (a collective of a function
    called twice is listed twice; its ``op_name`` is prefixed with the call's name). A
    collective is ``conditional`` when it sits inside a region of a ``stablehlo.case``
    or ``stablehlo.if``. This reads the program before XLA optimizes it (no all-reduce
    combining), for any target platform, without a device of that kind.

    Args:
      module: the module, or its text.
      mesh: the mesh its device positions refer to, to name the axes of each group.

    Returns:
      A CommunicationReport (``bytes`` from the result types; ``name`` is the SSA name
      of the results, e.g. ``"%3:2"``; ``computation`` is "").

    Example:
      >>> mlir = '''func.func @main(%p: tensor<i1>, %x: tensor<3xf32>) -> tensor<3xf32> {
      ... %0 = "stablehlo.if"(%p) ({
      ... %1 = "stablehlo.all_reduce"(%x) <{replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>}> ({
      ...   ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      ...     %s = stablehlo.add %a, %b : tensor<f32>
      ...     stablehlo.return %s : tensor<f32>
      ...   }) : (tensor<3xf32>) -> tensor<3xf32> loc("cond/branch_1_fun/psum")
      ...   stablehlo.return %1 : tensor<3xf32>
      ... }, {
      ...   stablehlo.return %x : tensor<3xf32>
      ... }) : (tensor<i1>) -> tensor<3xf32>
      ... return %0 : tensor<3xf32>
      ... }'''
      >>> [(c.kind, c.group_size, c.bytes, c.conditional, c.branch, c.name)
      ...  for c in parse_stablehlo(mlir)]
      [('all-reduce', 2, 12, True, 1, '%1')]
    """
    if isinstance(module, str):
        module = _compat.stablehlo_module(module)
    walk = _StableHLOWalk(module, mesh)
    walk.regions(walk.entry(), _Site())
    return CommunicationReport(walk.out)


def _find_mesh(args: Iterable[Any]) -> Any:
    import jax

    for leaf in jax.tree.leaves(list(args)):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if mesh is not None and hasattr(mesh, "devices"):
            return mesh
    return None


def communication_report(
    jitted_step: Any, *args: Any, mesh: Any = None, platform: str | None = None, **kwargs: Any
) -> CommunicationReport:
    """What a jitted step communicates: one record per collective of its compiled HLO.

    Compiles ``jitted_step`` for ``args`` (nothing runs) and lists every collective
    with its kind, group size, the mesh axes of its groups, the bytes each device sends
    into it, and whether it is ``conditional`` (inside a ``lax.cond``/``lax.switch``
    branch, so it runs only on some steps) or runs on every call.

    Args:
      jitted_step: a ``jax.jit``-wrapped function, an already compiled
        ``jax.stages.Compiled``, or the step of :func:`data_parallel_step`.
      *args: example arguments (arrays or ``jax.ShapeDtypeStruct`` with shardings);
        for a :func:`data_parallel_step` step, its own arguments, e.g. ``(params,
        opt_state, batch)``.
      mesh: the mesh whose axes name the groups; default the mesh of the first argument
        with a ``NamedSharding``.
      platform: when given (e.g. ``"cuda"`` or ``"tpu"``), the step is lowered for that
        platform with ``jax.export`` instead of compiled here, and its StableHLO module is walked
        (before XLA's optimizations, see ``parse_stablehlo``; no device of that kind is
        needed).
      **kwargs: keyword arguments of ``jitted_step``.

    Returns:
      A CommunicationReport (a tuple of Collective); print it for a table.

    Example:
      >>> import jax, jax.numpy as jnp, lsgd_jax
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = lsgd_jax.make_mesh(2, 4)
      >>> f = jax.jit(jax.shard_map(lambda x: jax.lax.pmean(x, "local"), mesh=mesh,
      ...     in_specs=P(("node", "local")), out_specs=P(("node", "local"))))
      >>> x = jax.device_put(jnp.ones(8), NamedSharding(mesh, P(("node", "local"))))
      >>> [(c.kind, c.axes, c.bytes, c.conditional) for c in lsgd_jax.communication_report(f, x)]
      [('all-reduce', ('local',), 4, False)]
    """
    if hasattr(jitted_step, "jit_args"):  # a DataParallelStep: its own signature
        args, jitted_step = jitted_step.jit_args(*args), jitted_step.jitted
    if mesh is None:
        mesh = _find_mesh(list(args) + list(kwargs.values()))
    if platform is not None:
        from jax import export

        exported = export.export(jitted_step, platforms=(platform,))(*args, **kwargs)
        return parse_stablehlo(_compat.stablehlo_module(exported), mesh=mesh)
    if hasattr(jitted_step, "as_text") and not hasattr(jitted_step, "lower"):
        compiled = jitted_step
    else:
        compiled = jitted_step.lower(*args, **kwargs).compile()
    return parse_hlo(compiled.as_text(), mesh=mesh)
