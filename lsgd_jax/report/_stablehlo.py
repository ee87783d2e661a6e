"""Reading a lowered program's StableHLO module (for a platform not present here):
the functions a call reaches, and each collective in them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from jaxlib.mlir import ir

from lsgd_jax._core import _compat
from lsgd_jax.report._records import Collective, CommunicationReport, _axes_of, _operand_bytes

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
