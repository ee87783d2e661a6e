"""A setup for the user's link: each candidate's step time predicted from the measured link
and compute and the bytes of its compiled programs, ranked, and the chosen chain."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh

from lsgd_jax import step
from lsgd_jax._core import _validate
from lsgd_jax.planner import _checks as checks
from lsgd_jax.planner import _compute
from lsgd_jax.planner._candidates import CANDIDATES, Candidate
from lsgd_jax.planner._link import Link, measure_link

TIE = 0.02  # predicted run times this close count as equal


@dataclasses.dataclass(frozen=True)
class Row:
    """One candidate's prediction.

    Attributes:
      name: the candidate's.
      step_s: its average step over the run, seconds.
      run_s: the run's predicted seconds.
      speedup: DDP's run time over this one's.
      link_bytes: bytes on the links between nodes over the run.
      bytes_ratio: DDP's link bytes over this one's.
      risk: the candidate's quality risk (nats per byte), or None.
      measured: where the risk was measured.
      phase_step_s: ``{"<link bytes> B in <n> collectives": predicted seconds}``, one
        per kind of step.
      reach: the share of the run after which it is within the plan's tolerance of a
        tuned DDP's final loss (``Candidate.reach``), or None: never.
      target_s: the predicted seconds until then, or None.
      candidate: the :class:`Candidate`.
      elapsed_s: the predicted seconds of the run's first ``j / (len - 1)`` share, for
        each ``j`` (``to_within`` reads it).
      phase_compute_s: each kind of step's compute (keys as ``phase_step_s``): its
        program timed on the mesh less its predicted link seconds, or the plan's
        ``compute_s`` where it was not timed.
      timed_phases: the kinds of step that were timed.
    """

    name: str
    step_s: float
    run_s: float
    speedup: float
    link_bytes: int
    bytes_ratio: float
    risk: float | None
    measured: str
    phase_step_s: dict[str, float] = dataclasses.field(hash=False)
    reach: float | None = None
    target_s: float | None = None
    candidate: Candidate | None = dataclasses.field(default=None, hash=False, repr=False)
    elapsed_s: tuple[float, ...] = dataclasses.field(default=(), hash=False, repr=False)
    phase_compute_s: dict[str, float] = dataclasses.field(default_factory=dict, hash=False)
    timed_phases: tuple[str, ...] = ()

    def to_within(self, tolerance: float) -> float | None:
        """The predicted seconds until this setup is within ``tolerance`` of a tuned
        DDP's final loss (its candidate's ``reach``), or None: never."""
        tolerance = _validate.real_number(tolerance, "Row.to_within: tolerance", "0.01")
        if self.candidate is None:
            return self.run_s if self.risk is not None and self.risk <= tolerance else None
        reach = self.candidate.reach(tolerance)
        if reach is None:
            return None
        if len(self.elapsed_s) < 2:
            return reach * self.run_s
        x = reach * (len(self.elapsed_s) - 1)
        j = min(int(x), len(self.elapsed_s) - 2)
        a, b = self.elapsed_s[j], self.elapsed_s[j + 1]
        return a + (x - j) * (b - a)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What ``lsgd_jax.plan`` found: the link and compute it measured (or was given), every
    candidate ranked by its predicted time to within the tolerance of a tuned DDP's final
    loss, and the chosen one with its chain.

    Attributes:
      link: the :class:`Link`.
      compute_s: one step's seconds without its communication across nodes.
      rows: the candidates, fastest to within the tolerance first (then the others, by
        run time).
      chosen: the fastest row to within the tolerance.
      tx: the chosen chain (the user's optimizer inside).
      tolerance: the quality risk allowed (nats per byte).
      probe: the link probe's timings (empty when the link was given).
      probe_s: the link probe's seconds, wall clock (0 when the link was given).
      phase_budget_s: the budget for timing kinds of step (0: none was to be timed: a
        link or compute given, or a budget of 0).
      timed_calls: the timed calls of each kind timed (0: none timed).
      timing_s: the seconds that timing took, wall clock.
      call_overhead_s: what a call through the step adds to its compiled program,
        added to each kind timed (0: none timed).
      flat_link: the link as fitted for one all-reduce over every device (None: the
        link was given, or a node has one device).
    """

    link: Link
    compute_s: float
    rows: tuple[Row, ...]
    chosen: Row
    tx: Any
    tolerance: float
    probe: tuple[dict[str, Any], ...] = dataclasses.field(default=(), hash=False)
    flat_link: Link | None = None
    probe_s: float = 0.0
    phase_budget_s: float = 0.0
    timed_calls: int = 0
    timing_s: float = 0.0
    call_overhead_s: float = 0.0

    def choose(self, tolerance: float) -> Row:
        """The row this plan would choose at another ``tolerance`` (same rule), its
        ``reach`` and ``target_s`` at that tolerance. Its chain: ``row.candidate.make(
        optimizer, num_steps)`` (``tx`` is the plan's own choice's).

        Raises:
          ValueError: no candidate is within ``tolerance``.
        """
        tolerance = _validate.real_number(tolerance, "Plan.choose: tolerance", "0.01")
        row = _choose(self.rows, tolerance, "Plan.choose")
        reach = None if row.candidate is None else row.candidate.reach(tolerance)
        return dataclasses.replace(row, reach=reach, target_s=row.to_within(tolerance))

    def __str__(self) -> str:
        rate = self.link.bytes_per_s * 8 / 1e6
        flat = self.flat_link
        also = "" if flat is None else (
            f" (one flat all-reduce over every device: {flat.bytes_per_s * 8 / 1e6:,.1f} "
            f"Mbit/s, {flat.latency_s * 1e3:.3f} ms)"
        )  # fmt: skip
        head = [
            f"link: {rate:,.1f} Mbit/s, {self.link.latency_s * 1e3:.3f} ms a collective{also}; "
            f"compute {self.compute_s * 1e3:.1f} ms a local step{_timed_kinds(self)}; "
            f"tolerance {self.tolerance}",
            f"| setup | step (ms) | speed over DDP | to within {self.tolerance} (s, share of "
            "the run) | node-link MB, run | DDP's bytes / its | quality risk (nats/byte) |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        for r in self.rows:
            mark = " **(chosen)**" if r is self.chosen else ""
            risk = "not measured" if r.risk is None else f"{r.risk:+.4f} ({r.measured})"
            reach = "never" if r.target_s is None else f"{_short(r.target_s)} ({r.reach:.0%})"
            head.append(
                f"| {r.name}{mark} | {r.step_s * 1e3:.1f} | {r.speedup:.2f}x | {reach} | "
                f"{_short(r.link_bytes / 1e6)} | {_short(r.bytes_ratio)} | {risk} |"
            )
        return "\n".join(head)


def predict(
    ledger: Any, link: Link, compute_s: float | Mapping[Any, float], flat_link: Link | None = None
) -> np.ndarray:
    """Each step's predicted seconds: compute, then each collective across nodes waits
    the link's latency and its bytes cross at the link's rate (no overlap).

    Args:
      ledger: the run's ``communication_ledger``.
      link: the link, as fitted for collectives over the node axis.
      compute_s: a step's seconds without what it spends across nodes; or
        ``{phase: seconds}`` keyed as ``ledger.phases`` (a kind of step's own; a
        ``Row``'s dicts are keyed by labels instead).
      flat_link: the link as fitted for one collective over every device (a flat
        gradient mean's ring waits the link at more hops); None: ``link``.

    Example:
      >>> import jax.numpy as jnp, optax, lsgd_jax
      >>> from lsgd_jax.planner import Link, predict
      >>> mesh = lsgd_jax.make_mesh(2, 4)
      >>> tx = optax.chain(lsgd_jax.post_local_sgd(10), optax.sgd(0.1))  # DDP
      >>> step = lsgd_jax.data_parallel_step(lambda p, b: jnp.mean((b @ p) ** 2), tx, mesh)
      >>> p = lsgd_jax.replicate(jnp.zeros(256), mesh)
      >>> s = lsgd_jax.replicate(tx.init(jnp.zeros(256)), mesh)
      >>> ledger = lsgd_jax.communication_ledger(step, p, s, jnp.ones((8, 256)), num_steps=2)
      >>> predict(ledger, Link(1e6, 0.001), compute_s=0.01).round(4).tolist()
      [0.0146, 0.0146]
    """
    if not (hasattr(ledger, "phases") and hasattr(ledger, "steps")):
        raise TypeError(f"predict: ledger must be a communication_ledger, got {ledger!r}.")
    for name, value in (("link", link), ("flat_link", flat_link)):
        if not (isinstance(value, Link) or (name == "flat_link" and value is None)):
            raise TypeError(f"predict: {name} must be a lsgd_jax.planner.Link, got {value!r}.")
    if isinstance(compute_s, Mapping):
        missing = [k for k in ledger.phases if k not in compute_s]
        extra = [k for k in compute_s if k not in ledger.phases]
        if missing or extra:
            raise ValueError(
                f"predict: compute_s must have seconds for each of the ledger's phases "
                f"{list(ledger.phases)} (the keys of ledger.phases), or be one number for "
                f"all; missing {missing}, not phases {extra}."
            )
        compute = {k: _seconds(compute_s[k]) for k in ledger.phases}
    else:
        compute = dict.fromkeys(ledger.phases, _seconds(compute_s))
    seconds = {k: _link_seconds(phase, link, flat_link) for k, phase in ledger.phases.items()}
    return np.array([compute[k] + seconds[k] for k in ledger.steps])


def _seconds(compute_s: Any) -> float:
    """``compute_s`` checked: a number of seconds, >= 0."""
    compute_s = _validate.real_number(compute_s, "predict: compute_s", "0.05")
    if compute_s < 0:
        raise ValueError(f"predict: compute_s is seconds, >= 0; got {compute_s}.")
    return compute_s


def _link_seconds(phase: Any, link: Link, flat_link: Link | None = None) -> float:
    """The seconds one step of ``phase`` (a ledger's ``PhaseBytes``) spends on the link:
    each collective across nodes, its latency and its bytes at the link's rate (a
    collective of one group over every device at ``flat_link``'s)."""
    total = 0.0
    for collective, link_bytes in phase.crossing:
        flat = flat_link if flat_link is not None and collective.num_groups == 1 else None
        total += (flat or link).seconds(link_bytes)
    return total


def plan(
    loss_fn: Callable[..., Any],
    params: Any,
    batch: Any,
    mesh: Mesh,
    optimizer: Any,
    *,
    num_steps: int,
    tolerance: float = 0.01,
    link: Link | None = None,
    compute_s: float | None = None,
    candidates: Sequence[Candidate] = CANDIDATES,
    node_axis: str = "node",
    flat_link: Link | None = None,
    phase_budget_s: float = 60.0,
) -> Plan:
    """The setup for this link: measures it (and one step's compute) unless given,
    predicts every candidate's step time from the bytes of its compiled programs, and
    picks the one predicted to get within ``tolerance`` of a tuned DDP's final loss
    soonest (its step times over the share of the run its measured quality curve needs;
    of those within 2% of it, the one of lowest risk).

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss``, as for ``data_parallel_step``.
      params: the model's params (one replica, not replicated).
      batch: one global batch (several processes: a global ``jax.Array``).
      mesh: the training mesh (``make_mesh(nodes, devices_per_node)``).
      optimizer: the inner optax optimizer (e.g. ``optax.adamw(...)``).
      num_steps: the run's length (the schedules and the bytes are the run's).
      tolerance: the quality asked for: nats per byte of loss above a tuned DDP's final
        one (the candidates' ``risk`` and ``curve``, from docs/lm.md).
      link: a ``lsgd_jax.planner.Link`` to use instead of measuring one.
      compute_s: one step's seconds without its communication across nodes, to use
        instead of measuring it (measured: ``measure_compute``'s local step, less its
        loss mean's predicted time on the measured link; with ``link`` given, all of it).
      candidates: the setups to weigh (default ``CANDIDATES``).
      node_axis: the mesh axis across nodes.
      flat_link: with ``link``: the link as one all-reduce over every device sees it
        (measured with the link; None: ``link``).
      phase_budget_s: with link and compute measured: predicted seconds, in all, to
        time every kind of step of every candidate (its compute: its time less its
        link's); none is timed if it affords fewer than 3 calls of each, nor a kind over
        2 s a step (those get the local step's compute). 0: none timed.

    Returns:
      A ``lsgd_jax.planner.Plan``; ``print(plan)`` shows the table, ``plan.tx`` is the chosen chain.

    Raises:
      ValueError: ``num_steps`` or ``tolerance`` is not valid, or no candidate is within
        the tolerance.

    Example:
      >>> import jax.numpy as jnp, optax, lsgd_jax
      >>> mesh = lsgd_jax.make_mesh(2, 4)
      >>> chosen = lsgd_jax.plan(
      ...     lambda p, b: jnp.mean((b @ p) ** 2), jnp.zeros(4096), jnp.ones((8, 4096)),
      ...     mesh, optax.sgd(0.1), num_steps=300, tolerance=0.05,
      ...     link=lsgd_jax.planner.Link(12.5e6, 0.001), compute_s=0.01)
      >>> chosen.chosen.name
      'DiLoCo H=16, 8-bit averages, 4-bit warm-up to 1/15'
    """
    num_steps = _validate.positive_int(num_steps, "plan: num_steps")
    tolerance = _validate.real_number(tolerance, "plan: tolerance", "0.01")
    phase_budget_s = _validate.real_number(phase_budget_s, "plan: phase_budget_s", "60.0")
    if not phase_budget_s >= 0:
        raise ValueError(f"plan: phase_budget_s is seconds, >= 0; got {phase_budget_s}.")
    candidates = checks.checked_candidates(candidates)
    if not any(c.risk is not None and c.risk <= tolerance for c in candidates):
        _none_within(tolerance, {c.name: c.risk for c in candidates})  # before any probe
    checks.check_mesh(mesh, node_axis, candidates)
    checks.check_inner_optimizer(optimizer, params)
    checks.check_one_replica(params)
    timing = link is None and compute_s is None  # the mesh's own link: its steps timed
    try:  # the model as the steps will take it, before any probe
        local, fresh_local = _compute.local_step(loss_fn, params, batch, mesh, optimizer)
    except (TypeError, ValueError) as e:
        raise type(e)(f"plan: {e}") from e
    started, measured = time.perf_counter(), link is None
    link, flat_link, probe = _links(mesh, node_axis, link, flat_link, params)
    probe_s = time.perf_counter() - started if probe else 0.0
    inner = tuple(a for a in mesh.axis_names if a != node_axis)
    if compute_s is None:
        # a link given may not be this mesh's: nothing of it taken off the step timed here
        paid = (lambda phase: _link_seconds(phase, link, flat_link)) if measured else None
        compute_s = _compute.local_compute(local, fresh_local, paid, inner)
    compute_s = _validate.real_number(compute_s, "plan: compute_s", "0.05")
    if compute_s < 0:
        raise ValueError(
            f"plan: compute_s is one step's compute in seconds, >= 0; got {compute_s}."
        )
    # DDP is the reference of the speed and bytes columns, weighed or not
    weighed = [*candidates] + [c for c in CANDIDATES[:1] if not any(c is w for w in candidates)]
    built = []  # every candidate's step and ledger first: the timing's budget is shared
    for candidate in weighed:
        tx = _compute.made(candidate, optimizer, num_steps)
        one = step.data_parallel_step(loss_fn, tx, mesh)
        fresh = _compute.arguments(params, tx, batch, mesh)
        ledger = step.communication_ledger(one, *fresh(), num_steps=num_steps, inner_axes=inner)
        link_s = {k: _link_seconds(ph, link, flat_link) for k, ph in ledger.phases.items()}
        built.append((candidate, tx, one, fresh, ledger, link_s))
    budget = phase_budget_s if timing else 0.0
    repeats = _compute.phase_repeats(budget, compute_s, [b[-1] for b in built])
    started = time.perf_counter()  # kinds are timed as programs: a call adds this
    many = max(built, key=lambda b: len(b[4].phases))  # a step of many phases, as most
    overhead = _compute.call_overhead(many[2], many[3](), max(repeats, 10)) if repeats else 0.0
    found = []
    for candidate, tx, one, fresh, ledger, link_s in built:
        timed, budget = _compute.phase_compute(one, fresh, ledger, link_s, budget, compute_s,
                                               repeats, overhead)  # fmt: skip
        found.append((candidate, tx, *_predicted(ledger, link, flat_link, link_s, compute_s,
                                                 timed)))  # fmt: skip
    timing_s = time.perf_counter() - started if repeats else 0.0
    ddp = next(f for f in found if f[0] is CANDIDATES[0])
    found = [f for f in found if any(f[0] is c for c in candidates)]
    ranked, (chosen, tx) = _ranked(found, ddp, num_steps, tolerance)
    return Plan(link, compute_s, ranked, chosen, tx, tolerance, probe, flat_link, probe_s,
                phase_budget_s if timing else 0.0, repeats if timing else 0, timing_s,
                overhead)  # fmt: skip


def _predicted(
    ledger: Any, link: Link, flat_link: Link | None, link_s: dict[Any, float],
    compute_s: float, timed: dict[Any, float],
) -> tuple[Any, ...]:  # fmt: skip
    """A candidate's ``(mean step, link bytes, {kind: step}, elapsed, {kind: compute},
    kinds timed)``, each kind charged its timed compute or else ``compute_s``."""
    compute = {k: timed.get(k, compute_s) for k in ledger.phases}
    seconds = predict(ledger, link, compute, flat_link)
    per_step, counts = ledger.link_per_step(), ledger.collectives("across")
    names = _phase_names(ledger.steps, per_step, counts)
    phases = {names[k]: float(compute[k] + link_s[k]) for k in ledger.phases}
    computes = {names[k]: float(compute[k]) for k in ledger.phases}
    mean, total = float(seconds.mean()), int(per_step.sum())
    return mean, total, phases, _elapsed(seconds), computes, tuple(names[k] for k in timed)


def _phase_names(steps: Sequence[Any], per_step: Any, counts: Any) -> dict[Any, str]:
    """``{phase: "<link bytes> B in <n> collectives"}`` (its index added where two kinds
    of step send alike)."""
    names: dict[Any, str] = {}
    for k, b, n in zip(steps, per_step, counts):
        names.setdefault(k, f"{b:,} B in {n} collective{'s' if n != 1 else ''}")
    for k, name in names.items():
        if list(names.values()).count(name) > 1:
            names[k] = f"{name} (phase {k})"
    return names


def _links(
    mesh: Mesh, node_axis: str, link: Any, flat_link: Any, params: Any
) -> tuple[Link, Link | None, tuple[dict[str, Any], ...]]:
    """``(link, flat_link, probe timings)``: as given, or measured (the flat one from a
    one-value all-reduce and one of the params' sizes, a flat gradient mean's)."""
    if flat_link is not None and (link is None or not isinstance(flat_link, Link)):
        raise TypeError(
            f"plan: flat_link must be a lsgd_jax.planner.Link given with link=, got "
            f"flat_link={flat_link!r} and link={link!r}."
        )
    if link is not None:
        if not isinstance(link, Link):
            raise TypeError(
                f"plan: link must be a lsgd_jax.planner.Link, got {link!r}; e.g. "
                "link=Link(bytes_per_s=12.5e6, latency_s=0.001) for 100 Mbit/s and 1 ms."
            )
        return link, flat_link, ()
    link, timings = measure_link(mesh, node_axis=node_axis)
    if mesh.devices.size == mesh.shape[node_axis]:  # one device a node: no flat ring
        return link, None, tuple(timings)
    axes = tuple(mesh.axis_names)
    try:
        flat_link, flat = measure_link(
            mesh, node_axis=node_axis, axes=axes, sizes=(1,), like=params
        )
    except ValueError:  # small params on a fast link: as fast as one value; a larger size
        flat_link, flat = measure_link(
            mesh, node_axis=node_axis, axes=axes, sizes=(1, 1 << 18), like=params
        )
    return link, flat_link, tuple(timings) + tuple(flat)


def _timed_kinds(found: Plan) -> str:
    """What the plan timed on the mesh, for the table's head."""
    timed = sum(len(r.timed_phases) for r in found.rows)
    kinds = sum(len(r.phase_step_s) for r in found.rows)
    if timed:
        return (f" ({timed} of {kinds} kinds of step timed on the mesh, {found.timed_calls} "
                f"calls each, {found.timing_s:.1f} s; the others over 2 s a step)"
                if timed < kinds else
                f" (every kind of step timed on the mesh, {found.timed_calls} calls each, "
                f"{found.timing_s:.1f} s)")  # fmt: skip
    if found.phase_budget_s > 0:
        return (f" (no kind of step timed: phase_budget_s={found.phase_budget_s:g} affords "
                "fewer than 3 calls of each, or each is over 2 s a step; every kind charged "
                "this)")  # fmt: skip
    return " (no kind of step timed: a link or compute given, or phase_budget_s=0)"


def _short(x: float) -> str:
    """A table's number: one decimal from 1 up, three significant digits below."""
    return f"{x:,.1f}" if x >= 1 else f"{x:.3g}"


def _elapsed(seconds: np.ndarray, points: int = 1000) -> tuple[float, ...]:
    """The predicted seconds of the run's first ``j / k`` share, ``j = 0..k`` (``k``: the
    steps, at most ``points``; linear within a step)."""
    k = min(len(seconds), points)
    total = np.concatenate([[0.0], np.cumsum(seconds)])
    shares = np.linspace(0.0, len(seconds), k + 1)
    return tuple(float(t) for t in np.interp(shares, np.arange(len(total)), total))


def _ranked(
    found: list[tuple[Any, ...]], ddp: tuple[Any, ...], num_steps: int, tolerance: float
) -> tuple[tuple[Row, ...], tuple[Row, Any]]:
    """The rows by predicted time to within the tolerance (then the others, by run
    time), and the chosen row with its chain (``_choose``)."""
    ranked: list[tuple[Row, Any]] = []
    for candidate, tx, step_s, link_bytes, phases, elapsed, computes, timed in found:
        row = Row(
            candidate.name, step_s, step_s * num_steps, ddp[2] / step_s, link_bytes,
            ddp[3] / max(link_bytes, 1), candidate.risk, candidate.measured, phases,
            candidate=candidate, elapsed_s=elapsed, phase_compute_s=computes,
            timed_phases=timed,
        )  # fmt: skip
        row = dataclasses.replace(row, reach=candidate.reach(tolerance),
                                  target_s=row.to_within(tolerance))  # fmt: skip
        ranked.append((row, tx))
    ranked.sort(key=lambda r: (r[0].target_s is None, r[0].target_s or r[0].run_s))
    rows = tuple(r[0] for r in ranked)
    chosen = _choose(rows, tolerance)
    return rows, next(r for r in ranked if r[0] is chosen)


def _none_within(tolerance: float, risks: dict[str, float | None], who: str = "plan") -> None:
    """Raises the error for a tolerance that no candidate meets."""
    if tolerance < 0:
        raise ValueError(
            f"{who}: tolerance is nats per byte of loss above a tuned DDP's final one, "
            f">= 0 (0.01 is strict, 0.05 loose); got {tolerance}."
        )
    measured = [r for r in risks.values() if r is not None]
    fix = (
        f"raise the tolerance to at least {min(measured)}" if measured else
        "give your candidates a measured risk (a risk of None is never chosen)"
    )  # fmt: skip
    raise ValueError(
        f"{who}: no candidate is within tolerance={tolerance} (their risks: {risks}); {fix}, "
        "or pass candidates= with a setup you trust."
    )


def _choose(rows: Sequence[Row], tolerance: float, who: str = "plan") -> Row:
    """Of ``rows``, the one predicted to get within the tolerance soonest; of those
    within ``TIE`` of it (as fast, as far as a prediction can tell), the lowest risk."""
    allowed = [(t, r) for r in rows if (t := r.to_within(tolerance)) is not None]
    if not allowed:
        _none_within(tolerance, {r.name: r.risk for r in rows}, who)
    fastest = min(t for t, _ in allowed)
    near = [(t, r) for t, r in allowed if t <= fastest * (1 + TIE)]
    return min(near, key=lambda tr: (tr[1].risk, tr[0]))[1]
