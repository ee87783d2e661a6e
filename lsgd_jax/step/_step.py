"""data_parallel_step: a per-replica loss function into a jitted post-local SGD step.

The step is a :class:`DataParallelStep`: it checks its inputs, chooses the compiled
program of this step's phase (``_step_program``) from the step counters it follows on
the host (``_phase_plan``), and keeps at most a few steps in flight; its input guards
are in ``_step_inputs``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optax
from jax.sharding import Mesh

from lsgd_jax._core import _fsdp, _validate
from lsgd_jax.mesh import assert_replicas_in_sync, check_cpu_threads, data_axes
from lsgd_jax.report import communication_report
from lsgd_jax.step import _ahead, _flight, _preflight, _step_inputs, _step_program
from lsgd_jax.step._phase_plan import PhasePlan
from lsgd_jax.step._step_program import MAX_PHASES, StepSpec, averager_states

__all__ = ["MAX_PHASES", "DataParallelStep", "averager_states", "data_parallel_step"]


def data_parallel_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    has_aux: bool = False,
    with_model_state: bool = False,
    axes: Sequence[str] | None = None,
    donate: bool = True,
    max_in_flight: int | None = 2,
    check_in_sync_every: int | None = None,
    specialize: str | bool = "phase",
    lowering: str = "shard_map",
    overlap: bool | None = None,
    compile_ahead: int = 4,
    fsdp_axes: str | Sequence[str] | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    check_order: bool = True,
    example_params: Any = None,
) -> DataParallelStep:
    """A jitted, donated ``shard_map`` training step over per-replica params and state.

    Each replica computes ``loss_fn`` on its rows of the batch and applies ``tx`` to its own
    params (see :func:`replicate`); without :func:`post_local_sgd` in ``tx`` it is plain
    DDP. Model state, aux, phases and checks in depth: docs/options_in_depth.md.

    Args:
      loss_fn: ``(params, batch) -> loss``, or ``-> (loss, aux)`` with ``has_aux``; with
        model state ``(params, model_state, batch) -> (loss, new_model_state)``.
      tx: the optimizer; ``post_local_sgd`` first, ``model_averaging`` last.
      mesh: e.g. :func:`make_mesh`; further (model) axes are left to the compiler.
      has_aux: ``loss_fn`` also returns aux (floats averaged over replicas, ints summed).
      with_model_state: ``loss_fn`` takes and returns (per-replica) model state.
      axes: the data-parallel axes; default :func:`data_axes` of ``mesh``.
      donate: donate the params, model state and optimizer state buffers.
      max_in_flight: most dispatched steps run ahead of the host; None: no limit.
      check_in_sync_every: run :func:`assert_replicas_in_sync` every this many calls.
      specialize: ``"phase"`` (True), ``"switch"`` or ``"cond"`` (False): how phases compile.
      lowering: ``"shard_map"``, or ``"jit"``: the loss under ``jax.jit`` and ``vmap``.
      overlap: deprecated, no effect (``True`` warns; docs/performance.md).
      compile_ahead: compile the phases of the next this many calls in the background.
      fsdp_axes: mesh axes to shard each replica over (FSDP; ``lowering="shard_map"`` only).
      compiler_options: XLA options for every program (as ``jax.jit``'s).
      check_order: refuse a chain out of order (see :func:`check_configuration`).
      example_params: one replica's params (or shapes) to check now; None: at first call.

    Returns:
      A :class:`DataParallelStep`: ``step(params, [model_state,] opt_state, batch) ->
      (params, [model_state,] opt_state, loss[, aux])``, ``loss`` the replicas' mean.

    Raises:
      TypeError: an argument of the wrong type.
      ValueError: a bad value, or a chain or mesh the checks refuse (naming the fix).

    Example:
      >>> import jax.numpy as jnp, optax, lsgd_jax
      >>> mesh = lsgd_jax.make_mesh(2, 4)
      >>> tx = optax.chain(lsgd_jax.post_local_sgd(2), optax.sgd(0.1),
      ...     lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, warmup_steps=2)))
      >>> step = lsgd_jax.data_parallel_step(lambda p, b: jnp.mean((b @ p - 1) ** 2), tx, mesh)
      >>> p, s = (lsgd_jax.replicate(t, mesh) for t in (jnp.zeros(3), tx.init(jnp.zeros(3))))
      >>> for _ in range(4): p, s, loss = step(p, s, jnp.ones((16, 3)))
      >>> round(float(loss), 3)
      0.004
    """
    axes = _step_inputs.check_axes(mesh, axes if axes is not None else data_axes(mesh))
    check_cpu_threads(mesh)  # warns once if XLA's CPU pool is too small for the devices
    specialize = _step_inputs.check_modes(specialize, lowering, overlap)
    has_aux, with_model_state, donate = (
        _validate.boolean(value, f"data_parallel_step: {name}")
        for name, value in (
            ("has_aux", has_aux),
            ("with_model_state", with_model_state),
            ("donate", donate),
        )
    )
    fsdp = _fsdp.check_axes(mesh, axes, fsdp_axes, "data_parallel_step: fsdp_axes")
    if fsdp and lowering != "shard_map":
        raise ValueError(
            f"data_parallel_step: fsdp_axes={fsdp_axes!r} needs lowering='shard_map' (got "
            f"{lowering!r}); with lowering='jit', shard the params over a model axis "
            "yourself and leave it to the compiler."
        )
    options = _step_inputs.check_compiler_options(compiler_options)
    check_order = _validate.boolean(check_order, "data_parallel_step: check_order")
    spec = StepSpec(
        loss_fn,
        tx,
        mesh,
        axes,
        has_aux,
        with_model_state,
        donate,
        lowering,
        fsdp,
        options,
        check_order,
    )
    checked = None
    if example_params is not None:
        example_params = _step_inputs.check_example_params(example_params)
        checked = _preflight.signature(_preflight.abstract(example_params))
    _step_program.check_when_built(spec, example_params)
    return DataParallelStep(
        spec,
        specialize=specialize,
        max_in_flight=_validate.optional_positive_int(
            max_in_flight, "data_parallel_step: max_in_flight"
        ),
        check_in_sync_every=_validate.optional_positive_int(
            check_in_sync_every, "data_parallel_step: check_in_sync_every"
        ),
        compile_ahead=_validate.nonnegative_int(compile_ahead, "data_parallel_step: compile_ahead"),
        checked_model=checked,
    )


class DataParallelStep:
    """The training step that :func:`data_parallel_step` builds.

    Call it as ``step(params, opt_state, batch)`` (or ``step(params, model_state,
    opt_state, batch)`` with model state); see :func:`data_parallel_step` for what it
    returns. ``step.communication_report(params, opt_state, batch)`` (or
    ``lsgd_jax.communication_report(step, params, opt_state, batch)``) lists what it
    communicates, compiled for those arguments without running it.

    Every call returns complete state: whatever it leaves in flight (a delayed average)
    is in the optimizer state it returns, so a checkpoint, another step object (any
    ``specialize`` or ``lowering``) or the elastic loop continues it exactly.

    Attributes:
      jitted: the step as ONE ``jax.jit`` function (every phase in it, under one
        ``lax.switch``, or with the transforms' conds when ``specialize=False``), with
        the signature ``(params, model_state, opt_state, batch) -> (params,
        model_state, opt_state, loss, aux, ok)`` (``model_state`` and ``aux`` None where
        unused): what reports and exports read. Calls use one program per phase.
      spec: what the step computes (loss, optimizer, mesh, axes, options).
      with_model_state: whether the step takes and returns model state.
      has_aux: whether the step returns ``aux``.
    """

    def __init__(
        self,
        spec: StepSpec,
        *,
        specialize: bool | str,
        max_in_flight: int | None,
        check_in_sync_every: int | None,
        compile_ahead: int = 0,
        checked_model: Any = None,
    ) -> None:
        self.spec = spec
        self.with_model_state = spec.with_model_state
        self.has_aux = spec.has_aux
        self._specialize = specialize
        self._plan = PhasePlan(specialize)  # which program each call runs
        self._programs = _ahead.Programs(lambda mode: _step_program.program(spec, mode))
        self._compile_ahead = compile_ahead
        self._in_flight = _flight.InFlight(max_in_flight)
        self._phase_checks = _flight.PhaseChecks()

        def first_call(params: Any, opt_state: Any) -> None:
            _step_program.check_at_first_call(spec, params, opt_state, checked_model)

        self._inputs = _step_inputs.Inputs(
            spec.mesh, spec.axes, spec.with_model_state, spec.fsdp_axes, first_call
        )
        self._check_in_sync_every = check_in_sync_every
        self._calls = 0

    @property
    def jitted(self) -> Any:
        return self.program("cond" if self._specialize == "cond" else "switch")

    def program(self, mode: int | str) -> Any:
        """The jitted program of ``mode``: a phase index (see :func:`phase_index`),
        ``"switch"`` or ``"cond"``, with :attr:`jitted`'s signature."""
        return self._programs.get(mode)

    def jit_args(self, *args: Any) -> tuple[Any, Any, Any, Any]:
        """``(params, model_state, opt_state, batch)`` for :attr:`jitted` from the step's
        own arguments (``model_state`` None without model state)."""
        return self._inputs.arguments(args)

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        params, model_state, opt_state, batch = self.jit_args(*args)
        every = self._check_in_sync_every
        if every is not None and self._calls % every == 0:
            assert_replicas_in_sync(opt_state)
        self._calls += 1
        self._inputs.check(params, model_state, opt_state, batch)
        mode = self._plan.mode(opt_state)
        program = self._programs.ready(mode)
        params, model_state, opt_state, loss, aux, ok = program(
            params, model_state, opt_state, batch
        )
        self._inputs.returned(params, model_state, opt_state)
        if isinstance(mode, int):
            self._plan.advance(opt_state)  # the next call with it continues the plan
            if self._compile_ahead:
                coming = self._plan.coming(self._compile_ahead)
                self._programs.compile_coming(coming, (params, model_state, opt_state, batch))
            self._phase_checks.add(self._calls, mode, ok)
        self._in_flight.add(loss)
        out: tuple[Any, ...] = (params, opt_state, loss)
        if self.with_model_state:
            out = (params, model_state, opt_state, loss)
        return out + ((aux,) if self.has_aux else ())

    def compile(self, *args: Any, num_steps: int) -> dict[int | str, float]:
        """Compiles, without running, the programs of the next ``num_steps`` calls.

        With one program per phase, each phase compiles when it first occurs, which
        stalls that step; a timed or latency-sensitive run calls this first, so that
        no step compiles. Nothing is donated or changed.

        Args:
          *args: the step's own arguments, e.g. ``(params, opt_state, batch)``, as
            the first of those calls will get them.
          num_steps: how many calls to plan for (their phases are replayed from the
            state's counters).

        Returns:
          ``{program: seconds}`` for each program compiled now (a phase index, or
          ``"switch"`` / ``"cond"``); programs compiled before are left out.

        Example:
          >>> import jax.numpy as jnp, optax, lsgd_jax
          >>> mesh = lsgd_jax.make_mesh(2, 4)
          >>> tx = optax.chain(lsgd_jax.post_local_sgd(2), optax.sgd(0.1),
          ...     lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, warmup_steps=2)))
          >>> step = lsgd_jax.data_parallel_step(lambda p, b: jnp.mean((b @ p) ** 2), tx, mesh)
          >>> p = lsgd_jax.replicate(jnp.zeros(3), mesh)
          >>> s = lsgd_jax.replicate(tx.init(jnp.zeros(3)), mesh)
          >>> sorted(step.compile(p, s, jnp.ones((8, 3)), num_steps=6))  # phases 2, 1, 0
          [0, 1, 2]
        """
        plan = self.plan_of(*args, num_steps=num_steps)
        return self._programs.compile(plan, self.jit_args(*args))

    def plan_of(self, *args: Any, num_steps: int) -> list[int | str]:
        """The program (phase index, or ``"switch"`` / ``"cond"``) each of the next
        ``num_steps`` calls from these arguments runs, replayed from the step counters.
        The arguments are checked as a call checks them (so ``compile`` and the ledger
        refuse a batch the step would refuse)."""
        num_steps = _validate.positive_int(num_steps, "num_steps")
        jit_args = self.jit_args(*args)
        self._inputs.check(*jit_args)
        return self._plan.replay(jit_args[2], num_steps)

    def programs_of(self, *args: Any, num_steps: int) -> list[tuple[int | str, Any]]:
        """``(program, jax.stages.Compiled)`` for each program of the next ``num_steps``
        calls, in the order they first occur, compiled where needed (see :meth:`compile`)."""
        jit_args = self.jit_args(*args)
        modes = dict.fromkeys(self.plan_of(*args, num_steps=num_steps))
        return [(k, self._programs.compiled(k, jit_args)) for k in modes]

    def lower(self, *args: Any) -> Any:
        """``jitted.lower`` for the step's own arguments (``jax.stages.Lowered``)."""
        return self.jitted.lower(*self.jit_args(*args))

    def communication_report(self, *args: Any, **kwargs: Any) -> Any:
        """What this step communicates for these arguments (see communication_report).

        Args:
          *args: the step's own arguments, e.g. ``(params, opt_state, batch)``.
          **kwargs: passed to :func:`communication_report` (``mesh``, ``platform``).

        Returns:
          A CommunicationReport.

        Example:
          >>> import jax.numpy as jnp, optax, lsgd_jax
          >>> mesh = lsgd_jax.make_mesh(2, 4)
          >>> tx = optax.chain(lsgd_jax.post_local_sgd(2), optax.sgd(0.1))
          >>> step = lsgd_jax.data_parallel_step(lambda p, b: jnp.mean((b @ p) ** 2), tx, mesh)
          >>> p = lsgd_jax.replicate(jnp.zeros(3), mesh)
          >>> s = lsgd_jax.replicate(tx.init(jnp.zeros(3)), mesh)
          >>> report = step.communication_report(p, s, jnp.ones((8, 3)))
          >>> sorted({c.scope for c in report})
          ['metrics', 'post_localSGD_hook']
        """
        return communication_report(self, *args, **kwargs)
