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
from collections.abc import Sequence
from typing import Any

import numpy as np

from lsgd_jax._core import _validate
from lsgd_jax._core._replicas import LOCAL_AXIS
from lsgd_jax.report import CommunicationReport, parse_hlo
from lsgd_jax.step import _phase
from lsgd_jax.step._phase_plan import skips_on_device

_WHERE = ("across", "inside", "all")
DDP = "ddp"  # the label of a step with nothing phased (no hook, no averager): plain DDP


def crosses_nodes(collective: Any, inner_axes: tuple[str, ...]) -> bool:
    """Whether ``collective``'s groups span nodes: it names a mesh axis outside the node's
    own ``inner_axes`` (or its axes are unknown, which counts as crossing).

    Example:
      >>> from lsgd_jax import Collective
      >>> from lsgd_jax.step._ledger import crosses_nodes
      >>> c = Collective("all-reduce", 2, 4, ("node",), 16, False, "ar", "f", "", ())
      >>> crosses_nodes(c, ("local",))
      True
    """
    if collective.axes is None:
        return True
    return any(a not in inner_axes for a in collective.axes)


def link_bytes(collective: Any, node_of: Any) -> int:
    """Bytes ``collective`` puts on the links between nodes, every device together
    (both directions), for ring algorithms with each group's devices in node order.

    A ring over a group whose devices sit in ``k > 1`` nodes crosses ``k`` node
    boundaries, each hop carrying one device's wire bytes (all-reduce, all-gather,
    reduce-scatter); a permute's pair whose source and target sit in different nodes
    carries ``bytes`` one way; an all-to-all sends ``bytes / g`` from each device to
    each member of its group, and counts what goes to members in other nodes. So a flat
    all-reduce over 2 nodes of 4 devices puts ``2 x`` its per-device wire bytes on the
    link, not ``8 x``: most of its ring stays inside the nodes. Groups unknown (no
    replica groups): every device's wire bytes (an upper bound).

    Args:
      collective: a :class:`~lsgd_jax.Collective`.
      node_of: a device position in the mesh -> its node (any hashable).

    Returns:
      The bytes crossing node boundaries per call, summed over devices.

    Example:
      >>> from lsgd_jax import Collective
      >>> from lsgd_jax.step._ledger import link_bytes
      >>> flat = Collective("all-reduce", 8, 1, ("node", "local"), 800, False, "ar", "f",
      ...                   "", (tuple(range(8)),))
      >>> link_bytes(flat, lambda p: p // 4)   # 2 crossings of 2 * 7 / 8 * 800 bytes
      2800
    """
    groups = collective.replica_groups
    if not groups:
        return collective.wire_bytes * max(collective.group_size, 1) * collective.num_groups
    total = 0
    for group in groups:
        nodes = [node_of(p) for p in group]
        spans = len(set(nodes))
        if spans < 2:
            continue
        if collective.kind == "collective-permute":  # (source, target): one way
            total += collective.bytes
        elif collective.kind in ("all-to-all", "ragged-all-to-all"):
            share = collective.bytes / len(group)
            total += sum(share * sum(m != n for m in nodes) for n in nodes)
        else:
            total += spans * collective.wire_bytes
    return round(total)


def _each_its_own_node(position: int) -> int:
    """``node_of`` without a mesh: every device a node of its own."""
    return position


def mesh_nodes(mesh: Any, inner_axes: tuple[str, ...]) -> Any:
    """``position -> node`` for ``mesh``: a device's coordinates on the axes that are
    not ``inner_axes`` (positions are row-major indices into ``mesh.devices``)."""
    if mesh is None:
        return _each_its_own_node
    shape = tuple(mesh.devices.shape)
    outer = [i for i, a in enumerate(mesh.axis_names) if a not in inner_axes]

    def node_of(position: int) -> tuple[int, ...]:
        coords = np.unravel_index(position, shape)
        return tuple(int(coords[i]) for i in outer)

    return node_of


@dataclasses.dataclass(frozen=True)
class PhaseBytes:
    """What one phase's program sends, per device and call.

    Attributes:
      report: its collectives (a CommunicationReport).
      across: bytes into collectives whose groups span nodes.
      across_wire: the same, as wire bytes (``Collective.wire_bytes``).
      inside: bytes into collectives that stay inside a node.
      inside_wire: the same, as wire bytes.
      across_count: how many collectives span nodes (on a slow link each one costs a
        latency, whatever its size).
      inside_count: how many stay inside a node.
      link: bytes on the links between nodes, every device together
        (``link_bytes`` in this module): what a node's network interfaces carry, less framing.
      crossing: ``(collective, its link bytes)`` for each collective that spans nodes.
    """

    report: CommunicationReport
    across: int
    across_wire: int
    inside: int
    inside_wire: int
    across_count: int = 0
    inside_count: int = 0
    link: int = 0
    crossing: tuple[tuple[Any, int], ...] = ()

    @classmethod
    def of(
        cls,
        report: CommunicationReport,
        inner_axes: tuple[str, ...],
        node_of: Any = _each_its_own_node,
    ) -> PhaseBytes:
        """Totals of ``report``'s collectives, split at the node boundary; the one-time
        copy of a common anchor (scope ``common_anchor``: ``delta`` and an outer step
        without ``outer_skip_first``, until each fragment's first global average) is
        left out. ``node_of`` (a device position -> its node) gives ``link``; without
        it ``link`` counts every crossing collective's wire bytes on every device."""
        report = CommunicationReport(c for c in report if "common_anchor" not in c.scope)
        cross = [crosses_nodes(c, inner_axes) for c in report]
        crossing = tuple((c, link_bytes(c, node_of)) for c, x in zip(report, cross) if x)
        return cls(
            report,
            sum(c.bytes for c, x in zip(report, cross) if x),
            sum(c.wire_bytes for c, x in zip(report, cross) if x),
            sum(c.bytes for c, x in zip(report, cross) if not x),
            sum(c.wire_bytes for c, x in zip(report, cross) if not x),
            sum(cross),
            len(cross) - sum(cross),
            sum(b for _, b in crossing),
            crossing,
        )


@dataclasses.dataclass(frozen=True)
class Ledger:
    """Bytes per device of each step of a run, from its compiled programs and schedule.

    Attributes:
      phases: ``{phase: PhaseBytes}``, one per phase the run takes (a phase index; or
        ``"switch"`` / ``"cond"`` when the phase of each call cannot be known ahead;
        ``"ddp"`` for a step whose optimizer has no phases, no post_local_sgd hook and
        no averager: plain data parallel, the same gradient mean every call).
      steps: the phase of each step, in order (length ``num_steps``).
      inner_axes: the mesh axes inside one node.
      exact: False when the step runs one program for every phase and its optimizer
        may skip updates (``optax.MultiSteps``, ``apply_if_finite``, masks), so the
        phase of each call is decided on the device: every step is then charged all
        of its program's collectives, branches it does not take included (an upper
        bound).
    """

    phases: dict[Any, PhaseBytes]
    steps: tuple[Any, ...]
    inner_axes: tuple[str, ...]
    exact: bool = True

    def per_step(self, where: str = "across", wire: bool = False) -> np.ndarray:
        """Bytes per device of each step: ``"across"`` nodes, ``"inside"`` them, or
        ``"all"``; ``wire=True`` for wire bytes (what links carry) instead of the
        bytes that go into the collectives."""
        _validate.one_of(where, "Ledger.per_step: where", _WHERE)
        parts = ("across", "inside") if where == "all" else (where,)
        suffix = "_wire" if wire else ""
        cost = {k: sum(getattr(v, p + suffix) for p in parts) for k, v in self.phases.items()}
        return np.array([cost[k] for k in self.steps], np.int64)

    def collectives(self, where: str = "across") -> np.ndarray:
        """How many collectives each step runs: ``"across"`` nodes, ``"inside"`` them,
        or ``"all"`` (each one waits at least a link's latency)."""
        _validate.one_of(where, "Ledger.collectives: where", _WHERE)
        parts = ("across", "inside") if where == "all" else (where,)
        cost = {k: sum(getattr(v, p + "_count") for p in parts) for k, v in self.phases.items()}
        return np.array([cost[k] for k in self.steps], np.int64)

    def total(self, where: str = "across", wire: bool = False) -> int:
        """Bytes per device over the whole run (see :meth:`per_step`)."""
        return int(self.per_step(where, wire).sum())

    def link_per_step(self) -> np.ndarray:
        """Bytes on the links between nodes in each step, every device together (both
        directions; ring algorithms, ``link_bytes`` in this module): what the nodes' network
        interfaces carry, less framing. Unlike :meth:`per_step`, not per device: a flat
        all-reduce's ring crosses the node boundary at a few hops only, while a
        two-level exchange sends every device's share across."""
        return np.array([self.phases[k].link for k in self.steps], np.int64)

    def link_total(self) -> int:
        """Bytes on the links between nodes over the whole run (:meth:`link_per_step`)."""
        return int(self.link_per_step().sum())

    def __str__(self) -> str:
        counts = {k: self.steps.count(k) for k in self.phases}
        head: tuple[str, ...] = ("program", "steps", "across/step", "wire across/step")
        head += ("inside/step", "ops across", "node links/step")
        rows = [head] + [
            (
                str(k),
                str(counts[k]),
                f"{v.across:,}",
                f"{v.across_wire:,}",
                f"{v.inside:,}",
                str(v.across_count),
                f"{v.link:,}",
            )
            for k, v in self.phases.items()
        ]
        rows.append(
            (
                "run",
                str(len(self.steps)),
                f"{self.total():,}",
                f"{self.total(wire=True):,}",
                f"{self.total('inside'):,}",
                f"{int(self.collectives().sum()):,}",
                f"{self.link_total():,}",
            )
        )
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if not self.exact:
            lines.append("(an upper bound: every branch of the one program is charged)")
        return "\n".join(lines)


def communication_ledger(
    step: Any, *args: Any, num_steps: int, inner_axes: str | Sequence[str] | None = None
) -> Ledger:
    """Bytes each device sends, across nodes and inside them, per step and per run.

    Compiles (without running) the programs ``step`` will run for its next ``num_steps``
    calls from these arguments (``step.compile``: the calls that follow then compile
    nothing), reads each one's collectives, and charges every step the bytes of its
    phase (replayed from the step counters). A collective crosses nodes when its groups
    span a mesh axis other than ``inner_axes``. Where the phase of a call is decided on
    the device (an optimizer that may skip updates) every branch is charged and
    ``ledger.exact`` is False. What is charged, and what it costs: docs/communication_report.md.

    Args:
      step: a step from :func:`data_parallel_step`.
      *args: its arguments for the first of those calls, e.g. ``(params, opt_state,
        batch)``.
      num_steps: how many calls the run makes.
      inner_axes: the mesh axes of one node's devices: a tuple of axis names, or one
        name (``"local"`` is ``("local",)``); ``()`` takes each device for a node of
        its own. Default: ``("local",)`` (:func:`make_mesh`'s axis inside a node), or
        ``()`` on a mesh without a ``"local"`` axis.

    Returns:
      A :class:`Ledger`: ``ledger.per_step()``, ``ledger.total()``, ``print(ledger)``;
      ``ledger.link_total()`` for the bytes on the links between nodes (every device
      together, as a node's network interface counts them).

    Raises:
      TypeError: ``step`` is not a :func:`data_parallel_step`, or ``inner_axes`` is not
        an axis name or a sequence of them.
      ValueError: ``inner_axes`` names an axis the step's mesh does not have.

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
      >>> ledger.link_total()   # node links, all devices: a flat ring crosses twice
      14476
    """
    from lsgd_jax.step._step import DataParallelStep

    if not isinstance(step, DataParallelStep):
        raise TypeError(
            f"communication_ledger expects a step from lsgd_jax.data_parallel_step, got "
            f"{step!r}; for any other jitted function use lsgd_jax.communication_report."
        )
    num_steps = _validate.positive_int(num_steps, "communication_ledger: num_steps")
    mesh = step.spec.mesh
    inner = _check_inner_axes(inner_axes, tuple(mesh.axis_names))
    plan = step.plan_of(*args, num_steps=num_steps)
    jit_args = step.jit_args(*args)
    opt_state = jit_args[2]
    one_program = isinstance(plan[0], str) and _phase.num_phases(opt_state) > 1
    skips = skips_on_device(opt_state)
    if one_program and not skips:  # charge each call its own branch: its phase's program
        plan = _phase.replay_phases(_phase.counters_snapshot(opt_state), num_steps).tolist()
        programs = [(k, step.program(k).lower(*jit_args).compile()) for k in dict.fromkeys(plan)]
    else:
        programs = step.programs_of(*args, num_steps=num_steps)
    if _phase.num_phases(opt_state) == 1:  # nothing phased: the step is DDP's, every call
        plan, programs = [DDP] * num_steps, [(DDP, c) for _, c in programs]
    node_of = mesh_nodes(mesh, inner)
    phases = {
        k: PhaseBytes.of(parse_hlo(c.as_text(), mesh=mesh), inner, node_of) for k, c in programs
    }
    return Ledger(phases, tuple(plan), inner, exact=not (one_program and skips))


def _check_inner_axes(inner_axes: Any, mesh_axes: tuple[str, ...]) -> tuple[str, ...]:
    """``inner_axes`` as a tuple of ``mesh_axes``' names (see communication_ledger)."""
    if inner_axes is None:
        return (LOCAL_AXIS,) if LOCAL_AXIS in mesh_axes else ()
    names = (inner_axes,) if isinstance(inner_axes, str) else inner_axes
    if not isinstance(names, (tuple, list)) or not all(isinstance(a, str) for a in names):
        raise TypeError(
            "communication_ledger: inner_axes must be a mesh axis's name or a tuple of "
            f"them (the axes of one node's devices, e.g. ('local',)), got {inner_axes!r}."
        )
    for name in names:
        if name not in mesh_axes:
            raise ValueError(
                f"communication_ledger: inner_axes names {name!r}, which is not an axis of "
                f"the step's mesh: the mesh's axes are {mesh_axes}. Pass the axes of one "
                "node's devices among them (make_mesh's is 'local'), or () for each "
                "device a node of its own."
            )
    return tuple(names)
