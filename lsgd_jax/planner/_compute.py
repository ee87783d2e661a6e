"""A step's compute on the user's mesh: the local phase of post-local SGD timed, and each
candidate's kinds of step timed from their compiled programs."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import optax
from jax.sharding import Mesh

from lsgd_jax import hook, step
from lsgd_jax import mesh as mesh_room
from lsgd_jax._core import _validate
from lsgd_jax.planner._link import pooled_median

PHASE_WARM = 3  # a kind of step's untimed calls (a collective's first calls set it up)
PHASE_REPEATS = (3, 30)  # its timed calls: as many as the budget affords, within these
PHASE_CAP_S = 2.0  # a kind of step predicted slower than this is not timed


def measure_compute(
    loss_fn: Callable[..., Any],
    params: Any,
    batch: Any,
    mesh: Mesh,
    optimizer: Any,
    *,
    repeats: int = 10,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds of one step's compute: the local phase of post-local SGD (gradients
    averaged inside each node only, as the candidates' local steps do; the loss mean
    across nodes that every step reports included), compiled once, run three times to
    warm up, then the median of ``repeats`` timed steps (every process's calls pooled:
    every process plans alike).

    Example:
      >>> import jax.numpy as jnp, optax, lsgd_jax
      >>> from lsgd_jax.planner import measure_compute
      >>> seconds = measure_compute(lambda p, b: jnp.mean((b @ p) ** 2), jnp.zeros(64),
      ...     jnp.ones((8, 64)), lsgd_jax.make_mesh(2, 4), optax.sgd(0.1), repeats=2)
      >>> 0 < seconds < 10
      True
    """
    repeats = _validate.positive_int(repeats, "measure_compute: repeats")
    local, fresh = local_step(loss_fn, params, batch, mesh, optimizer)
    return timed(local, fresh(), repeats, clock=clock)


def local_step(
    loss_fn: Callable[..., Any], params: Any, batch: Any, mesh: Mesh, optimizer: Any
) -> tuple[Any, Callable[[], tuple]]:
    """The step ``measure_compute`` times (post-local SGD's local phase), and ``() ->
    its arguments`` made afresh; built for ``params`` (one replica), so that a model the
    step refuses is refused here."""
    tx = optax.chain(hook.post_local_sgd(0), optimizer)
    local = step.data_parallel_step(loss_fn, tx, mesh, example_params=params)
    return local, arguments(params, tx, batch, mesh)


def local_compute(
    local: Any, fresh: Callable[[], tuple], link_seconds: Callable[[Any], float] | None,
    inner: tuple[str, ...],
) -> float:  # fmt: skip
    """A local step's seconds (the median of 20 calls), less what its loss mean across
    nodes waits on the link: ``link_seconds(its ledger's phase)`` (None: nothing taken
    off); at least 0."""
    paid = 0.0
    if link_seconds is not None:
        own = step.communication_ledger(local, *fresh(), num_steps=1, inner_axes=inner)
        paid = link_seconds(own.phases[own.steps[0]])
    return max(timed(local, fresh(), 20) - paid, 0.0)


def call_overhead(
    built: Any, args: tuple, repeats: int, warm: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> float:  # fmt: skip
    """Seconds a call of the step object adds to its compiled program (its input checks,
    its phase plan, the jitted call): ``built`` called in turn through the step and
    through the program of its next call, each pair's difference; the median of every
    process's differences pooled, at least 0. Kinds of step are timed as programs: this
    is what a user's call adds to each."""
    args, gaps = tuple(args), []
    for i in range(warm + repeats):
        start = clock()
        out = built(*args)
        jax.block_until_ready(out)
        through_step = clock() - start
        args = (*out[:-1], args[-1])
        ((_, program),) = built.programs_of(*args, num_steps=1)
        start = clock()
        params, model_state, opt_state, *rest = program(*built.jit_args(*args))
        jax.block_until_ready((params, model_state, opt_state, rest))
        gap = through_step - (clock() - start)
        if i >= warm:
            gaps.append(gap)
        args = (params, opt_state, args[-1])
    return max(pooled_median(gaps), 0.0)


def timed(
    call: Any,
    args: tuple,
    repeats: int,
    warm: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """The median seconds of ``repeats`` calls of ``call(*args)`` after ``warm`` untimed
    ones, each call fed the previous one's outputs in place of its arguments (the params
    and states it donates) and timed until all of them are ready; every process's calls
    pooled (one agreed value: the processes choose alike)."""
    args, times = tuple(args), []
    for i in range(warm + repeats):
        start = clock()
        out = call(*args)
        jax.block_until_ready(out)
        if i >= warm:
            times.append(clock() - start)
        args = tuple(out[: len(args) - 1]) + args[-1:]  # the batch stays
    return pooled_median(times)


def phase_repeats(budget_s: float, compute_s: float, link_s: Iterable[dict[Any, float]]) -> int:
    """The timed calls of each kind of step: as many as ``budget_s`` affords for every
    kind of every candidate (``link_s``: each candidate's ``{phase: link seconds}``)
    under ``PHASE_CAP_S``, at most ``PHASE_REPEATS[1]``; 0 (none timed) when it cannot
    afford ``PHASE_REPEATS[0]`` of every one: candidates timed in part and charged in
    part the local step's compute would not compare."""
    steps = [compute_s + s for kinds in link_s for s in kinds.values()]
    total = sum(s for s in steps if s <= PHASE_CAP_S)
    low, high = PHASE_REPEATS
    affords = budget_s / total - PHASE_WARM if total > 0 else high
    return int(min(high, affords)) if affords >= low else 0


def phase_compute(
    built: Any, make_args: Callable[[], tuple], ledger: Any, link_s: dict[Any, float],
    budget_s: float, compute_s: float, repeats: int, overhead_s: float = 0.0,
) -> tuple[dict[Any, float], float]:  # fmt: skip
    """Each kind of step's compute: its compiled program (as the ledger compiled it)
    timed on the mesh (``repeats`` calls after ``PHASE_WARM``), plus ``overhead_s`` (a
    call through the step: see ``call_overhead``), less its predicted seconds on the
    link (``link_s``), at least 0.

    A kind is timed while its predicted step (``compute_s`` plus its link seconds) is
    at most ``PHASE_CAP_S`` and its calls fit the ``budget_s`` left; the others are
    left out (the caller charges them ``compute_s``). Every process decides alike: from
    the predictions, never from its own clock. ``make_args()`` gives the step's
    arguments afresh (a timed call donates them).

    Returns:
      ``({phase: compute seconds}, budget_s left)``.
    """
    if budget_s <= 0 or repeats <= 0:
        return {}, budget_s
    programs = dict(built.programs_of(*make_args(), num_steps=len(ledger.steps)))
    if set(ledger.phases) != set(programs) and len(programs) == len(ledger.phases) == 1:
        programs = {next(iter(ledger.phases)): next(iter(programs.values()))}  # DDP's
    found: dict[Any, float] = {}
    for phase in ledger.phases:
        cost = (compute_s + link_s[phase]) * (PHASE_WARM + repeats)
        if phase not in programs or compute_s + link_s[phase] > PHASE_CAP_S or cost > budget_s:
            continue
        budget_s -= cost
        seconds = timed(programs[phase], built.jit_args(*make_args()), repeats, PHASE_WARM)
        found[phase] = max(seconds + overhead_s - link_s[phase], 0.0)
    return found, budget_s


def made(candidate: Any, optimizer: Any, num_steps: int) -> Any:
    """``candidate.make(optimizer, num_steps)``, its failure named."""
    try:
        tx = candidate.make(optimizer, num_steps)
    except Exception as e:
        raise RuntimeError(
            f"plan: candidate {candidate.name!r}: make(optimizer, num_steps) raised "
            f"{type(e).__name__}: {e}"
        ) from e
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            f"plan: candidate {candidate.name!r}: make(optimizer, num_steps) must return "
            f"an optax chain, got {tx!r}."
        )
    return tx


def arguments(params: Any, tx: Any, batch: Any, mesh: Mesh) -> Callable[[], tuple]:
    """``() -> (params, opt_state, batch)``: a candidate's step arguments, made afresh."""
    return lambda: (
        mesh_room.replicate(params, mesh),
        mesh_room.replicate(tx.init(params), mesh),
        batch,
    )
