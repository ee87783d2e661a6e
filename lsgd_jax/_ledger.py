"""The byte ledger: what a training step sends, per step, per phase and per run.

``communication_report`` lists one compiled program's collectives. A run of
``data_parallel_step`` runs one program per phase (global or node-local gradient mean,
times each averaging level), and which phase each step takes follows from the step
counters. The ledger puts the two together: it compiles the programs the step will
really run for the next ``num_steps`` calls (the same ones training then uses, so
nothing is compiled twice), reads each one's collectives, and charges every step the
bytes of its phase, split into what crosses nodes and what stays inside a node.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from lsgd_jax import _validate
from lsgd_jax._report import CommunicationReport, parse_hlo

_WHERE = ("across", "inside", "all")


def crosses_nodes(collective: Any, inner_axes: tuple[str, ...]) -> bool:
    """Whether ``collective``'s groups span nodes: it names a mesh axis outside the node's
    own ``inner_axes`` (or its axes are unknown, which counts as crossing).

    Example:
      >>> from lsgd_jax import Collective
      >>> from lsgd_jax._ledger import crosses_nodes
      >>> c = Collective("all-reduce", 2, 4, ("node",), 16, False, "ar", "f", "", ())
      >>> crosses_nodes(c, ("local",))
      True
    """
    if collective.axes is None:
        return True
    return any(a not in inner_axes for a in collective.axes)


@dataclasses.dataclass(frozen=True)
class PhaseBytes:
    """What one phase's program sends, per device and call.

    Attributes:
      report: its collectives (a CommunicationReport).
      across: bytes into collectives whose groups span nodes.
      across_wire: the same, as wire bytes (``Collective.wire_bytes``).
      inside: bytes into collectives that stay inside a node.
      inside_wire: the same, as wire bytes.
    """

    report: CommunicationReport
    across: int
    across_wire: int
    inside: int
    inside_wire: int

    @classmethod
    def of(cls, report: CommunicationReport, inner_axes: tuple[str, ...]) -> PhaseBytes:
        """Totals of ``report``'s collectives, split at the node boundary; the one-time
        copy of a common anchor (scope ``common_anchor``: ``delta`` and an outer step
        without ``outer_skip_first``, until each fragment's first global average) is
        left out."""
        report = CommunicationReport(c for c in report if "common_anchor" not in c.scope)
        cross = [crosses_nodes(c, inner_axes) for c in report]
        return cls(
            report,
            sum(c.bytes for c, x in zip(report, cross) if x),
            sum(c.wire_bytes for c, x in zip(report, cross) if x),
            sum(c.bytes for c, x in zip(report, cross) if not x),
            sum(c.wire_bytes for c, x in zip(report, cross) if not x),
        )


@dataclasses.dataclass(frozen=True)
class Ledger:
    """Bytes per device of each step of a run, from its compiled programs and schedule.

    Attributes:
      phases: ``{program: PhaseBytes}``, one per program the run uses (a phase index,
        or ``"switch"`` / ``"cond"`` for a step that runs one program).
      steps: the program of each step, in order (length ``num_steps``).
      inner_axes: the mesh axes inside one node.
    """

    phases: dict[Any, PhaseBytes]
    steps: tuple[Any, ...]
    inner_axes: tuple[str, ...]

    def per_step(self, where: str = "across", wire: bool = False) -> np.ndarray:
        """Bytes per device of each step: ``"across"`` nodes, ``"inside"`` them, or
        ``"all"``; ``wire=True`` for wire bytes (what links carry) instead of the
        bytes that go into the collectives."""
        _validate.one_of(where, "Ledger.per_step: where", _WHERE)
        parts = ("across", "inside") if where == "all" else (where,)
        suffix = "_wire" if wire else ""
        cost = {k: sum(getattr(v, p + suffix) for p in parts) for k, v in self.phases.items()}
        return np.array([cost[k] for k in self.steps], np.int64)

    def total(self, where: str = "across", wire: bool = False) -> int:
        """Bytes per device over the whole run (see :meth:`per_step`)."""
        return int(self.per_step(where, wire).sum())

    def __str__(self) -> str:
        counts = {k: self.steps.count(k) for k in self.phases}
        head = ("program", "steps", "across/step", "wire across/step", "inside/step")
        rows = [head] + [
            (str(k), str(counts[k]), f"{v.across:,}", f"{v.across_wire:,}", f"{v.inside:,}")
            for k, v in self.phases.items()
        ]
        rows.append(
            (
                "run",
                str(len(self.steps)),
                f"{self.total():,}",
                f"{self.total(wire=True):,}",
                f"{self.total('inside'):,}",
            )
        )
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def communication_ledger(
    step: Any, *args: Any, num_steps: int, inner_axes: Any = ("local",)
) -> Ledger:
    """Bytes each device sends, across nodes and inside them, per step and per run.

    Compiles (without running) the programs ``step`` will run for its next
    ``num_steps`` calls from these arguments, the same ones those calls then use
    (``step.compile``), reads each one's collectives, and charges
    every step the bytes of its phase (replayed from the step counters). A collective
    crosses nodes when its groups span a mesh axis other than ``inner_axes``. Inside a
    phase's program a collective under a conditional is charged whenever the phase
    runs (the model state's mean, which runs whenever the params average), except the
    one-time copy of a common anchor before the first global average (scope
    ``common_anchor``), which is left out.

    Args:
      step: a step from :func:`data_parallel_step`.
      *args: its arguments for the first of those calls, e.g. ``(params, opt_state,
        batch)``.
      num_steps: how many calls the run makes.
      inner_axes: the mesh axis (or axes) of one node's devices.

    Returns:
      A :class:`Ledger`: ``ledger.per_step()``, ``ledger.total()``, ``print(ledger)``.

    Example:
      >>> import jax.numpy as jnp, optax, lsgd_jax
      >>> mesh = lsgd_jax.make_mesh(2, 4)
      >>> tx = optax.chain(lsgd_jax.post_local_sgd(2), optax.sgd(0.1),
      ...     lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(4, warmup_steps=2)))
      >>> step = lsgd_jax.data_parallel_step(lambda p, b: jnp.mean((b @ p) ** 2), tx, mesh)
      >>> p = lsgd_jax.replicate(jnp.zeros(256), mesh)
      >>> s = lsgd_jax.replicate(tx.init(jnp.zeros(256)), mesh)
      >>> ledger = lsgd_jax.communication_ledger(step, p, s, jnp.ones((8, 256)), num_steps=10)
      >>> ledger.per_step().tolist()   # grads 1 KiB (+4 B loss), then an average every 4
      [1028, 1028, 1028, 4, 4, 4, 1028, 4, 4, 4]
    """
    from lsgd_jax._step import DataParallelStep

    if not isinstance(step, DataParallelStep):
        raise TypeError(
            f"communication_ledger expects a step from lsgd_jax.data_parallel_step, got "
            f"{step!r}; for any other jitted function use lsgd_jax.communication_report."
        )
    inner = (inner_axes,) if isinstance(inner_axes, str) else tuple(inner_axes)
    num_steps = _validate.positive_int(num_steps, "communication_ledger: num_steps")
    programs = step.programs_of(*args, num_steps=num_steps)
    mesh = step._spec.mesh
    phases = {k: PhaseBytes.of(parse_hlo(c.as_text(), mesh=mesh), inner) for k, c in programs}
    return Ledger(phases, tuple(step.plan_of(*args, num_steps=num_steps)), inner)
