"""data_parallel_step: a per-replica loss function into a jitted post-local SGD step.

The step is a :class:`DataParallelStep`: it checks its inputs, chooses the compiled
program of this step's phase (``_step_program``) from the step counters it follows on
the host, and keeps at most a few steps in flight.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from lsgd_jax import _overlap, _phase, _step_program, _validate
from lsgd_jax._averager_state import ModelAveragerState
from lsgd_jax._mesh import _num_replicas, data_axes
from lsgd_jax._step_program import MAX_PHASES, StepSpec, averager_states
from lsgd_jax._sync import assert_replicas_in_sync

__all__ = ["MAX_PHASES", "DataParallelStep", "averager_states", "data_parallel_step"]

# Wrappers whose inner state (ours inside) may skip an update: the host cannot follow
# the counters through them, so such steps branch on the device ("switch").
_SKIPPING_WRAPPERS = (
    optax.MultiStepsState,
    optax.ApplyIfFiniteState,
    optax.ConditionallyTransformState,
    optax.ConditionallyMaskState,
    optax.MaskedState,
)


def _path_name(path: Any) -> str:
    return jax.tree_util.keystr(path) or "(root)"


def _lead_axes(spec: Any, mesh: Any) -> tuple[str, ...]:
    """The mesh axes of size > 1 that shard the leading axis of ``spec``."""
    lead = tuple(spec)[0] if tuple(spec) else None
    lead = lead if isinstance(lead, tuple) else (lead,)
    return tuple(a for a in lead if a is not None and mesh.shape[a] > 1)


def _check_replicated(tree: Any, what: str, n: int, mesh: Mesh, axes: tuple[str, ...]) -> None:
    want = tuple(a for a in axes if mesh.shape[a] > 1)
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(x, jax.Array) and x.is_deleted():
            raise ValueError(
                f"data_parallel_step: {what} leaf {_path_name(path)} was donated to an "
                "earlier call of this step, which freed its buffer. Use the values the step "
                f"returned (params, opt_state, ... = step(params, opt_state, batch)), or "
                "build the step with donate=False to keep its inputs alive."
            )
        shape = jnp.shape(x)
        if not shape or shape[0] != n:
            raise ValueError(
                f"data_parallel_step: {what} leaf {_path_name(path)} has shape {shape}, but "
                f"per-replica values need a leading axis of {n} replicas (one per device "
                f"of {axes}). Make them with lsgd_jax.replicate({what}, mesh)."
            )
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and n > 1:
            if _lead_axes(sharding.spec, sharding.mesh) != want:
                raise ValueError(
                    f"data_parallel_step: {what} leaf {_path_name(path)} is sharded as "
                    f"{sharding.spec}, not over the replica axes {axes} on its leading axis; "
                    f"a P() value would be one copy for all replicas. Make it with "
                    f"lsgd_jax.replicate({what}, mesh)."
                )


class _Identity:
    """The step's own last outputs, held to recognize them (``is``) when passed straight
    back: those were checked and are alive."""

    def __init__(self, *objects: Any) -> None:
        self.objects = objects

    def same(self, *objects: Any) -> bool:
        return len(objects) == len(self.objects) and all(
            a is b for a, b in zip(objects, self.objects)
        )


def _overlap_position(opt_state: Any) -> int | None:
    """The index among the branching states of the one averager with a delay whose
    means can go in the background, or None."""
    states = _phase.branching_states(opt_state)
    delayed = [
        i for i, x in enumerate(states) if isinstance(x, ModelAveragerState) and x.averager.delay
    ]
    if len(delayed) != 1 or jax.process_count() > 1:
        # Two programs with collectives over the same several devices per process, run
        # from two threads, deadlock across processes in jax 0.10.2 (XLA:CPU with
        # gloo; measured with 2 processes x 2 or 4 devices, also on separate collective
        # contexts): several processes take the mean inside the step.
        return None
    averager = states[delayed[0]].averager
    # Local levels between a start and its landing would also use the communication
    # state (error feedback) that the background average updates: keep those in-program.
    stateful = states[delayed[0]].comm_state is not None
    if stateful and averager.num_levels > 1 and averager.sync_schedule.is_global(1) is False:
        return None
    return delayed[0]


def _check_batch(batch: Any, n: int, axes: tuple[str, ...], processes: int) -> None:
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = jnp.shape(x)
        if not shape or shape[0] % n:
            raise ValueError(
                f"data_parallel_step: batch leaf {_path_name(path)} has shape {shape}; its "
                f"leading (batch) axis must divide by the {n} replicas. Use a global batch "
                f"size that is a multiple of {n}."
            )
        if processes > 1 and not (isinstance(x, jax.Array) and not x.is_fully_addressable):
            warnings.warn(
                f"data_parallel_step: batch leaf {_path_name(path)} is a host-local array "
                f"on a mesh of {processes} processes, so it is taken as the GLOBAL "
                "batch (each device reads its rows of it, from its own process's copy): "
                "with different data on each process, most of it is silently dropped. Feed "
                "each process's own rows with jax.make_array_from_process_local_data("
                f"NamedSharding(mesh, P({axes})), local_batch).",
                stacklevel=5,
            )


def data_parallel_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    has_aux: bool = False,
    with_model_state: bool = False,
    axes: Sequence[str] | None = None,
    donate: bool = True,
    max_in_flight: int | None = 8,
    check_in_sync_every: int | None = None,
    specialize: bool | str = True,
    lowering: str = "shard_map",
    overlap: bool = True,
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
        waits for the loss of the step that many calls back). Unbounded async dispatch
        can deadlock XLA's in-process CPU collectives: seen with 8 simulated devices on
        2 cores after about 150 queued steps (jax 0.10.2). None: no limit.
      specialize: how the step's branches are compiled. ``True`` (default): one
        program per phase (global or node-local gradient mean, times each averaging
        level; see :func:`phase_index`), compiled when that phase first occurs and
        chosen on the host from the step counters, each with every hook and averager
        pinned to its branch, so it is straight-line code as fast as a hand-written
        step: the gradient all-reduce overlaps the backward pass, and the first step
        compiles one phase only. The host follows the counters itself (no wait for the
        device); each program also checks the phase on the device, and a program that
        meets another phase leaves the state unchanged and the step raises an error a
        few calls later. Under wrappers that may skip an update (``optax.MultiSteps``,
        ``apply_if_finite``, ``conditionally_transform``, ``masked``... whose states
        hold ours) it uses ``"switch"`` instead. ``"switch"``: one program, the whole
        step traced once per phase under one ``lax.switch`` (as fast, but every phase
        compiled at once; at most ``MAX_PHASES``, 16, else the conds). ``False``: one
        program with a ``lax.cond`` per transform (fuses worse: 12-40% slower on CPU,
        see benchmarks/overhead.py). The pin is static metadata of the states, so a
        ``jax.jit`` or ``jax.checkpoint`` around ``tx.update`` traces each phase apart.
        A collective's ``branch`` in :func:`communication_report` is the phase index.
      lowering: ``"shard_map"`` (default): the whole per-replica step runs inside one
        ``jax.shard_map`` over the data axes. ``"jit"``: for pjit-style code that never
        writes ``shard_map``: ``loss_fn`` runs under plain ``jax.jit``, mapped over the
        replica axis with ``jax.vmap`` (model axes sharded by the compiler, as in the
        rest of such a codebase), and only the update, whose means must name the data
        axes, runs inside a ``shard_map`` of its own. The same signature, layout,
        collectives (each conditional on its phase as before) and numbers.
      overlap: with an averager that has a ``delay`` (and ``specialize=True``), take
        each delayed average's mean in a program of its own, dispatched from a
        background thread, so that its collective runs while the next steps compute
        (XLA:CPU runs one program's collectives and compute one after the other; on
        GPU the next steps' kernels also overlap it). The same maths, on the same
        devices listed in another order (a separate collective context), so the same
        numbers up to the order of the float sums. A checkpoint saved while an average
        is in flight holds what its mean is taken from; resuming takes it again.
        One process only, for now: with several processes two programs with
        collectives over the same devices, run from two threads, deadlock in jax
        0.10.2 (XLA:CPU, gloo), so the mean is taken inside the step there.
        False: the mean is taken inside the step that starts the average.
      check_in_sync_every: on the first call and then every this many calls, run
        :func:`assert_replicas_in_sync` on the incoming optimizer state, so that replicas
        or processes whose step counters differ fail with an error instead of hanging
        in a collective. It waits for the previous step (and, with several processes,
        is a small collective). None: never.

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
    axes = tuple(axes) if axes is not None else data_axes(mesh)
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"data_parallel_step: the mesh has axes {mesh.axis_names}, not {missing}; pass "
            "axes=<its data-parallel axes> or build it with lsgd_jax.make_mesh()."
        )
    if specialize not in (True, False, "switch"):
        raise ValueError(
            f"data_parallel_step: specialize must be True, False or 'switch', got {specialize!r}."
        )
    _validate.one_of(
        lowering,
        "data_parallel_step: lowering",
        ("shard_map", "jit"),
        ": 'shard_map' (the whole step in one shard_map) or 'jit' (the loss under plain "
        "jax.jit, the collectives in a shard_map of their own)",
    )
    spec = StepSpec(loss_fn, tx, mesh, axes, has_aux, with_model_state, donate, lowering)
    return DataParallelStep(
        spec,
        specialize=specialize,
        max_in_flight=_validate.optional_positive_int(
            max_in_flight, "data_parallel_step: max_in_flight"
        ),
        check_in_sync_every=_validate.optional_positive_int(
            check_in_sync_every, "data_parallel_step: check_in_sync_every"
        ),
        overlap=_validate.boolean(overlap, "data_parallel_step: overlap"),
    )


class DataParallelStep:
    """The training step that :func:`data_parallel_step` builds.

    Call it as ``step(params, opt_state, batch)`` (or ``step(params, model_state,
    opt_state, batch)`` with model state); see :func:`data_parallel_step` for what it
    returns. ``step.communication_report(params, opt_state, batch)`` (or
    ``lsgd_jax.communication_report(step, params, opt_state, batch)``) lists what it
    communicates, compiled for those arguments without running it.

    Attributes:
      jitted: the step as ONE ``jax.jit`` function (every phase in it, under one
        ``lax.switch``, or with the transforms' conds when ``specialize=False``), with
        the signature ``(params, model_state, opt_state, batch) -> (params,
        model_state, opt_state, loss, aux, ok, deferred)`` (``model_state``, ``aux``
        and ``deferred`` None where unused): what reports and exports read. Calls use
        one program per phase.
      with_model_state: whether the step takes and returns model state.
      has_aux: whether the step returns ``aux``.
    """

    _CHECK_LAG = 16  # a phase program's ok flag is read this many calls later

    def __init__(
        self,
        spec: StepSpec,
        *,
        specialize: bool | str,
        max_in_flight: int | None,
        check_in_sync_every: int | None,
        overlap: bool = True,
    ) -> None:
        self._spec = spec
        self._mesh_processes = len({d.process_index for d in spec.mesh.devices.flat})
        self.with_model_state = spec.with_model_state
        self.has_aux = spec.has_aux
        self._specialize = specialize
        self._max_in_flight = max_in_flight
        self._check_in_sync_every = check_in_sync_every
        self._programs: dict[Any, Any] = {}
        self._layouts: dict[Any, tuple[int | str | None, int | None]] = {}
        self._overlap_wanted = overlap
        self._overlap: _overlap.Overlap | None = None
        self._digits = np.zeros((0, 0), np.int64)
        self._in_flight: collections.deque = collections.deque()
        self._unchecked: collections.deque = collections.deque()
        self._calls = 0
        self._plan: bool | None = None  # whether a replay of the counters is followed
        self._snapshot: Any = None
        self._position = 0  # index into the plan of the next call
        self._returned: Any = None  # the optimizer state the last call returned
        self._outputs = _Identity(None, None, None)  # what the last call returned

    @property
    def jitted(self) -> Any:
        return self._program("cond" if self._specialize is False else "switch")

    def _program(self, mode: int | str, defer: bool = False) -> Any:
        if (mode, defer) not in self._programs:
            spec = dataclasses.replace(self._spec, defer=defer)
            self._programs[mode, defer] = _step_program.program(spec, mode)
        return self._programs[mode, defer]

    def jit_args(self, *args: Any) -> tuple[Any, Any, Any, Any]:
        """``(params, model_state, opt_state, batch)`` for :attr:`jitted` from the step's
        own arguments (``model_state`` None without model state)."""
        names: tuple[str, ...] = ("params", "model_state", "opt_state", "batch")
        if not self.with_model_state:
            names = ("params", "opt_state", "batch")
        if len(args) != len(names):
            raise TypeError(
                f"data_parallel_step: the step takes ({', '.join(names)}), got {len(args)} "
                "arguments."
            )
        if self.with_model_state:
            return args
        params, opt_state, batch = args
        return params, None, opt_state, batch

    def _check(self, params: Any, model_state: Any, opt_state: Any) -> None:
        spec = self._spec
        n = _num_replicas(spec.mesh, spec.axes)
        _check_replicated(params, "params", n, spec.mesh, spec.axes)
        _check_replicated(opt_state, "opt_state", n, spec.mesh, spec.axes)
        if spec.with_model_state:
            _check_replicated(model_state, "model_state", n, spec.mesh, spec.axes)

    def _layout(self, opt_state: Any) -> tuple[int | str | None, int | None]:
        """From the state's structure alone (cached by tree structure): a fixed program
        (or None: one per phase, followed on the host), and the index among the
        branching states of a delayed averager whose means go in the background."""
        treedef = jax.tree.structure(opt_state)
        if treedef not in self._layouts:
            fixed: int | str | None = None
            if self._specialize is not True or _phase.num_phases(opt_state) == 1:
                fixed = "cond" if self._specialize is False else "switch"
            else:
                wrappers = jax.tree.leaves(
                    opt_state, is_leaf=lambda x: isinstance(x, _SKIPPING_WRAPPERS)
                )
                if any(isinstance(x, _SKIPPING_WRAPPERS) for x in wrappers):
                    fixed = "switch"
            position = (
                None
                if fixed is not None or not self._overlap_wanted
                else (_overlap_position(opt_state))
            )
            self._layouts[treedef] = (fixed, position)
        return self._layouts[treedef]

    def _mode(self, opt_state: Any) -> int | str:
        """This call's program: its phase, followed on the host, or one program."""
        if self._plan is None or opt_state is not self._returned:
            fixed, position = self._layout(opt_state)
            if fixed is not None:
                return fixed
            # A state this step did not just return (the first call, a restored or
            # reused state): read its counters once (the state must be computed).
            self._snapshot = _phase.counters_snapshot(opt_state)
            self._digits = _phase.replay_digits(self._snapshot, 8)
            self._position = 0
            self._overlap = self._start_overlap(position, opt_state)
        if self._position >= self._digits.shape[1]:
            self._digits = _phase.replay_digits(self._snapshot, 2 * self._digits.shape[1])
        self._plan = True
        radix = [s.num_phases for s in self._snapshot]
        index = 0
        for digit, n in zip(self._digits[:, self._position], radix):
            index = index * n + int(digit)
        return index

    def _start_overlap(self, position: int | None, opt_state: Any) -> _overlap.Overlap | None:
        if self._overlap is not None:
            self._overlap.close()  # a timeline left behind: its mean is not wanted
        if position is None:
            return None
        overlap = _overlap.Overlap(self._spec.mesh, self._spec.axes, position)
        overlap.start_from(opt_state)  # an average started before a checkpoint
        return overlap

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        params, model_state, opt_state, batch = self.jit_args(*args)
        every = self._check_in_sync_every
        if every is not None and self._calls % every == 0:
            assert_replicas_in_sync(opt_state)
        self._calls += 1
        if not self._outputs.same(params, model_state, opt_state):  # else: checked, alive
            self._check(params, model_state, opt_state)
        _check_batch(
            batch,
            _num_replicas(self._spec.mesh, self._spec.axes),
            self._spec.axes,
            self._mesh_processes,
        )
        mode = self._mode(opt_state)
        lands, starts = False, 0
        if self._overlap is not None and isinstance(mode, int):
            p = self._overlap.position
            lands, starts = self._overlap.events(self._snapshot[p], self._digits[p, self._position])
        if self._overlap is not None:  # the mean in flight, once it is ready
            opt_state = self._overlap.land(opt_state, wait=lands)
        program = self._program(mode, defer=self._overlap is not None)
        params, model_state, opt_state, loss, aux, ok, deferred = program(
            params, model_state, opt_state, batch
        )
        if starts:
            self._overlap.start(deferred, starts)  # type: ignore[union-attr]
        self._outputs = _Identity(params, model_state, opt_state)
        if isinstance(mode, int):
            self._position += 1
            self._returned = opt_state  # the next call with it continues the plan
            self._unchecked.append((self._calls, mode, ok))
            if len(self._unchecked) >= 2 * self._CHECK_LAG:  # the older half, at once
                for _ in range(self._CHECK_LAG):
                    self._check_phase(*self._unchecked.popleft())
        if self._max_in_flight is not None:
            self._in_flight.append(loss)
            if len(self._in_flight) > self._max_in_flight:
                self._in_flight.popleft().block_until_ready()
        out: tuple[Any, ...] = (params, opt_state, loss)
        if self.with_model_state:
            out = (params, model_state, opt_state, loss)
        return out + ((aux,) if self.has_aux else ())

    def _check_phase(self, call: int, mode: int, ok: Any) -> None:
        # The phase comes from the counters, equal on every replica: one flag tells.
        if not np.all(np.asarray(ok.addressable_data(0))):
            raise RuntimeError(
                f"data_parallel_step: call {call} ran the program of phase {mode}, but the "
                "optimizer state was in another phase, so that step changed nothing (and "
                "the later ones until now may not either). The step follows the step "
                "counters on the host, assuming each call advances every hook and averager "
                "by one; something in the optimizer skipped an update. Build the step with "
                "specialize='switch', which branches on the device."
            )

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
        from lsgd_jax._report import communication_report

        return communication_report(self, *args, **kwargs)
