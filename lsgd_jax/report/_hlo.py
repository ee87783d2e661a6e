"""Reading a compiled program's HLO text: its computations, the ones a call reaches
(conditionally or not), and each collective in them.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from lsgd_jax.report._records import (
    _KINDS,
    Collective,
    CommunicationReport,
    _axes_of,
    _operand_bytes,
    _type_bytes,
)

_COMP_START = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s+=\s+(.*)$")
_CALLEES = re.compile(
    r"\b(to_apply|calls|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"\b(branch_computations|called_computations)=\{([^}]*)\}")


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
