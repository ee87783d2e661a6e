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

    Each replica computes ``loss_fn`` on its slice of the global batch, runs ``tx`` (e.g.
    ``optax.chain(post_local_sgd(...), optimizer, model_averaging(...))``) on its own
    gradients, and applies the updates to its own params. Params and optimizer state are
    per replica (made by ``replicate(params, mesh)`` and ``replicate(tx.init(params),
    mesh)``), since local SGD lets replicas diverge between averages.

    Signatures (``B`` is the global batch, split over the replicas on its leading axis)::

        loss_fn(params, batch) -> loss                       # default
        loss_fn(params, batch) -> (loss, aux)                # has_aux=True
        loss_fn(params, model_state, batch) -> (loss, new_model_state)   # with_model_state
        loss_fn(params, model_state, batch) -> (loss, (new_model_state, aux))  # both

        step(params, opt_state, batch) -> (params, opt_state, loss[, aux])
        step(params, model_state, opt_state, batch)
            -> (params, model_state, opt_state, loss[, aux])

    ``loss`` is the mean over all replicas; floating ``aux`` leaves are averaged over the
    replicas and integer ones summed (e.g. counts of correct predictions). Model state
    (e.g. batch-norm statistics) is per replica and is averaged on the steps, and over the
    group, that the optimizer's model averager averages the params (exactly: it is
    assigned the mean), and only when the averager really ran (under
    ``optax.MultiSteps`` only on the mini-steps that emit an update). Without a model
    averager in ``tx`` (plain DDP) each replica keeps its own statistics (PyTorch's DDP
    instead broadcasts rank 0's buffers every step); evaluate with ``consensus``.

    Without :func:`post_local_sgd` in ``tx`` the step is plain DDP: it averages the
    gradients over every replica on every step (``data_parallel_step(loss_fn,
    optax.adamw(1e-3), mesh)`` is the synchronous baseline). A ``tx`` that averages models
    but has no hook is refused (its replicas could never differ). When it traces, the
    step also runs :func:`check_configuration` on the optimizer state.

    In the HLO (see :func:`communication_report`) the collectives are named by scope:
    ``post_localSGD_hook``, ``ddp``, ``model_averaging``, ``model_state_averaging``,
    ``metrics``.

    Flax NNX: rebuild the module inside ``loss_fn`` with ``nnx.merge(graphdef, params,
    model_state, copy=True)``; without ``copy=True`` NNX refuses to mutate batch
    statistics created at another trace level.

    Args:
      loss_fn: the per-replica loss, see above.
      tx: the optimizer; put ``post_local_sgd`` first and ``model_averaging`` last.
      mesh: the mesh, e.g. :func:`make_mesh`; may have further (model) axes, which stay
        automatic (the compiler shards over them).
      has_aux: whether ``loss_fn`` returns auxiliary outputs.
      with_model_state: whether ``loss_fn`` takes and returns model state.
      axes: the data-parallel axes; default :func:`data_axes` of ``mesh``.
      donate: donate the params, model state and optimizer state buffers.
      max_in_flight: at most this many dispatched steps run ahead of the host (the step
        waits for the loss of the step that many calls back; 2 was no slower than 8 on
        CPU). None: no limit. On CPU with simulated devices, also give XLA's pool two
        threads a device (:func:`simulate_cpu_devices`; "Threads for simulated CPU
        devices" in docs/training_loops.md): the step warns when it is built if not.
      specialize: how the step's branches are compiled. ``"phase"`` (default; ``True`` is
        its alias): one program per phase (global or node-local gradient mean, times each
        averaging level; see :func:`phase_index`), compiled when that phase first occurs and
        chosen on the host from the step counters, each with every hook and averager pinned
        to its branch, so it is straight-line code as fast as a hand-written step: the
        gradient all-reduce overlaps the backward pass, and the first step compiles one
        phase only. The host follows the counters itself (no wait for the device); each
        program also checks the phase on the device, and a program that meets another phase
        leaves the state unchanged and the step raises an error a few calls later. Under
        wrappers that may skip an update (``optax.MultiSteps``, ``apply_if_finite``,
        ``conditionally_transform``, ``masked``... whose states hold ours) it uses
        ``"switch"`` instead. ``"switch"``: one program, the whole step traced once per
        phase under one ``lax.switch`` (as fast, but every phase compiled at once; at most
        ``MAX_PHASES``, 16, else the conds). ``"cond"`` (``False`` is its alias): one
        program with a ``lax.cond`` per transform (fuses worse: 12-40% slower on CPU, see
        benchmarks/overhead.py). The pin is static metadata of the states, so a ``jax.jit``
        or ``jax.checkpoint`` around ``tx.update`` traces each phase apart. A collective's
        ``branch`` in :func:`communication_report` is the phase index.
      lowering: ``"shard_map"`` (default): the whole per-replica step runs inside one
        ``jax.shard_map`` over the data axes. ``"jit"``: for pjit-style code that never
        writes ``shard_map``: ``loss_fn`` runs under plain ``jax.jit``, mapped over the
        replica axis with ``jax.vmap`` (model axes sharded by the compiler, as in the
        rest of such a codebase), and only the update, whose means must name the data
        axes, runs inside a ``shard_map`` of its own. The same signature, layout and
        collectives (each conditional on its phase as before); the numbers are equal up
        to float rounding, since the compiler fuses the loss differently (measured:
        1e-6 after 8 SGD steps, 3e-5 after 8 AdamW steps of a 0.5M-parameter
        transformer).
      overlap: deprecated, no effect (None, the default, or False). It used to take a
        delayed average's mean in a background program on a second thread; that mean
        then lived only in the thread, so a state handed to a checkpoint or another
        step lost it, and the background program measured no faster on CPU (see
        docs/performance.md). Every step now returns complete state: a delayed
        average's mean is taken inside the step that starts it and kept in the
        averager's state until it lands. ``True`` warns.
      compile_ahead: with one program per phase, look this many calls ahead and compile
        the programs of phases still to come on a background thread while the steps
        run, so that a new phase does not stall its first step to compile (it waits
        only for what is left of that compile). 0: each phase compiles when it first
        occurs. ``step.compile(..., num_steps=N)`` compiles them all up front instead.
      fsdp_axes: mesh axes (not data axes) over which each replica spans devices, its
        params, model state, optimizer state and averager state sharded over them as
        ``replicate(..., shard_over=fsdp_axes)`` lays them out (FSDP / ZeRO-3 inside a
        replica): the step gathers a replica's params for the loss, splits the
        replica's rows of the batch over these axes, and reduces the gradients back
        onto the shards; every mean across replicas then moves one shard per device.
        The numbers are those of the unsharded run up to float rounding. Needs
        ``lowering="shard_map"``. None: each replica's values whole on its devices (a
        further model axis is left to the compiler, as said under ``mesh``).
      compiler_options: XLA options for every program of the step (as ``jax.jit``'s
        ``compiler_options``), e.g. ``{"xla_gpu_enable_latency_hiding_scheduler":
        True}`` on GPU; an option XLA does not know fails the first compile, naming it.
      check_in_sync_every: on the first call and then every this many calls, run
        :func:`assert_replicas_in_sync` on the incoming optimizer state, so that replicas
        or processes whose step counters differ fail with an error instead of hanging
        in a collective. It waits for the previous step (and, with several processes,
        is a small collective). None: never.
      check_order: refuse a chain whose ``post_local_sgd`` is not first or whose
        ``model_averaging`` is not last (see :func:`check_configuration`); False for an
        order composed on purpose.
      example_params: one replica's params (or their abstract shapes, as
        ``jax.ShapeDtypeStruct``), to run the checks that depend on the model's shapes
        when the step is built; None: they run at the first call, before the step does.

    What the step checks before the first step: the chain's order, and every phase the
    optimizer will run (the warm-up, the node-local means after the switch, each
    averaging level), traced on this mesh and on your model's shapes: an axis a later
    phase needs and the mesh lacks is an error when the step is built, naming the phase
    and the fix, not at step 10,000; what depends on the model (e.g. enough values for
    ``fragments``) is checked on ``example_params`` then, or at the first call. A mesh
    with Explicit axes (``jax.make_mesh``'s default) works: the step puts the batch
    onto the data axes itself.

    With several processes (one per node, see :func:`make_mesh`), every process calls
    the step with the same arguments: params and optimizer state from :func:`replicate`
    (or :func:`restore_checkpoint`), and a global batch assembled from each process's
    rows with ``jax.make_array_from_process_local_data(NamedSharding(mesh, P(axes)),
    local_batch)``.

    Returns:
      A :class:`DataParallelStep`: call it as shown above.

    Example:
      >>> import jax, jax.numpy as jnp, optax, lsgd_jax
      >>> mesh = lsgd_jax.make_mesh(2, 4)
      >>> tx = optax.chain(lsgd_jax.post_local_sgd(2), optax.sgd(0.1),
      ...     lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, warmup_steps=2)))
      >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p - b["y"]) ** 2)
      >>> step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh)
      >>> params = lsgd_jax.replicate(jnp.zeros(3), mesh)
      >>> opt_state = lsgd_jax.replicate(tx.init(jnp.zeros(3)), mesh)
      >>> batch = {"x": jnp.ones((16, 3)), "y": jnp.ones(16)}
      >>> for _ in range(4):
      ...     params, opt_state, loss = step(params, opt_state, batch)
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
        ``num_steps`` calls from these arguments runs, replayed from the step counters."""
        num_steps = _validate.positive_int(num_steps, "num_steps")
        return self._plan.replay(self.jit_args(*args)[2], num_steps)

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
