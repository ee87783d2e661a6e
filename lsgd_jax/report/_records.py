"""What a report holds: one record per collective (Collective), the report itself
(CommunicationReport), and the byte arithmetic both parsers share.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

_SHAPE = re.compile(r"([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")

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
          >>> from lsgd_jax.report._records import Collective, CommunicationReport
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
