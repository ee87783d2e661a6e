"""The elastic loop: every step an attempt under JAX's ``live_devices`` barrier, retried
on a failure over the live processes, a new membership healed in (see the package's
docstring, ``lsgd_jax.elastic``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lsgd_jax.elastic import _attempts, _elastic_checkpoint, _membership, _process
from lsgd_jax.elastic._initialize import shutdown
from lsgd_jax.elastic._membership import Layout
from lsgd_jax.elastic._records import ElasticResult, StepRecord, _record, _result, _split_outputs
from lsgd_jax.elastic._start import (
    _check_loop_args,
    _fresh_job,
    _fresh_state,
    _inside,
    _start_state,
)


def _consensus_work(model_state: bool) -> Callable[..., Any]:
    """The consensus attempt's work: the mean params (and model state) of the replicas."""
    from lsgd_jax.mesh import consensus

    def work(state, step, layout):
        if model_state:
            return consensus(state[0]), consensus(state[1])
        return consensus(state[0])

    return work


class _TrainWork:
    """One training attempt's work: the step's checkpoint save (when due), the batch of
    this process's rows, and the step program of the membership's mesh (built once per
    device order and kept with its compiled programs)."""

    def __init__(self, loss_fn, tx, options, batch_fn, checkpoints, on_attempt, inside) -> None:
        self._loss_fn, self._tx, self._options = loss_fn, tx, options
        self._batch_fn, self._checkpoints, self._on_attempt = batch_fn, checkpoints, on_attempt
        self._steps: dict[tuple[int, ...], Any] = {}
        self._axes = _attempts.loop_axes(inside)

    def step_fn(self, layout: Layout):
        from lsgd_jax.step import data_parallel_step

        key = tuple(d.id for d in layout.mesh.devices.flat)
        if key not in self._steps:
            self._steps[key] = data_parallel_step(
                self._loss_fn, self._tx, layout.mesh, axes=self._axes, donate=False, **self._options
            )
        return self._steps[key]

    def __call__(self, state, step: int, layout: Layout):
        ckpt = self._checkpoints
        if ckpt is not None and ckpt.due(step):
            ckpt.save(state, step, layout.processes)  # the state step `step` starts from
        if self._on_attempt is not None:
            self._on_attempt(step, layout)
        sharding = NamedSharding(layout.mesh, P(self._axes))
        local = self._batch_fn(step, layout)
        batch = jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local)
        return _split_outputs(self.step_fn(layout)(*state, batch), len(state))


class _Restart:
    """What the live processes restart from when none of them holds the model (every
    holder died, e.g. the sole survivor while a newcomer was still joining): the
    newest finalized checkpoint, or the fresh state if there is none yet and the run
    began fresh at step 0.

    Attributes:
      fresh_origin: whether this process's run began from the fresh state at step 0.
    """

    def __init__(self, checkpoints: _elastic_checkpoint.Checkpoints, template: tuple) -> None:
        self._checkpoints, self._template = checkpoints, template
        self.fresh_origin = False

    def step(self) -> int | None:
        """The step to restart from (on the membership's leader); None: nothing."""
        found = _elastic_checkpoint.latest_step(self._checkpoints.directory)
        if found is not None:
            return found
        return 0 if self.fresh_origin else None

    def state(self, mesh: Mesh, step: int) -> tuple[Any, ...]:
        """The state at ``step`` over ``mesh`` (every member of the view reads it)."""
        if step == 0:  # step 0 is never saved: it is the fresh state
            return _fresh_state(mesh, *self._template)
        init_params, tx, init_model_state, _ = self._template
        return self._checkpoints.restore(init_params, tx, init_model_state, step, mesh)


def _begin(attempts, checkpoints, template, num_steps: int, first_step: int, initial_state):
    """``(first step, state)`` of a run: the given state, the checkpoint a new job resumes
    from, or fresh (None); a process that (re)started after the run was over exits."""
    ran = attempts.view is not None
    if attempts.restart is not None:
        attempts.restart.fresh_origin = initial_state is None and first_step == 0
    if checkpoints is not None and _fresh_job(initial_state, first_step, ran):
        init_params, tx, init_model_state, _ = template
        resumed = checkpoints.resume(init_params, tx, init_model_state, num_steps)
        if resumed is not None:
            first_step, initial_state = resumed
    state = _start_state(num_steps, first_step, initial_state, ran, template)
    attempts.given = state  # moved onto the mesh by the first attempt that succeeds
    attempts.records_started, attempts.last_step = False, num_steps
    end = _membership.finished_step() if _process.newcomer() else None
    if end is not None and end >= num_steps:  # (re)started after the run was over
        raise _process.run_over(jax.process_index(), end)
    return first_step, state


class ElasticLoop:
    """A training loop that survives dead processes and takes restarted ones back.

    Every process of the job builds the same loop and calls :meth:`run`. Each step runs
    inside ``live_devices`` on a mesh of the live processes (one row, i.e. node, per
    process), built per membership and cached with its compiled programs. Each
    argument's contract in full, and what a failure costs: docs/failures.md.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (as for
        :func:`~lsgd_jax.data_parallel_step`).
      tx: the optimizer, e.g. ``optax.chain(post_local_sgd(...), optax.sgd(...),
        model_averaging(...))``.
      init_params: the initial params (the same on every process); a joining process
        uses them only for their shapes.
      batch_fn: ``batch_fn(step, layout) -> tree`` of this process's rows of the global
        batch of ``step``, called at every attempt of the step: return the same rows
        for the same step and process ("What you provide" in docs/failures.md).
      step_options: more keyword arguments for ``data_parallel_step`` (no donation or
        overlap), e.g. ``{"fsdp_axes": "local"}``: one replica per process (HSDP).
      stall_timeout_s: end this process if one attempt's own work (compiles excepted)
        goes on this many seconds (None: never); with several processes, longer than
        ``initialize()``'s ``collective_timeout_s + heartbeat_timeout_s``.
      max_failures: consecutive failed attempts after which :meth:`run` gives up; only
        errors that can mean a dead peer are retried, any other is raised at once.
      on_step: called with each :class:`StepRecord` as the step completes.
      on_attempt: called with ``(step, layout)`` as each attempt starts its step.
      checkpoint_dir: a folder to save checkpoints into and resume from (None: none).
      checkpoint_every: save at every step that is a multiple of it (needs
        ``checkpoint_dir``); call :meth:`shutdown` at the end to wait for the writes.
      init_model_state: the initial model state (the same on every process), for
        ``step_options={"with_model_state": True}`` only.

    Raises:
      TypeError: an argument of the wrong type.
      ValueError: a bad value, an unknown or forbidden step option, or a
        ``stall_timeout_s`` not longer than the collective and heartbeat timeouts.

    Example:
      >>> import lsgd_jax.elastic as elastic
      >>> loop = elastic.ElasticLoop(loss_fn, tx, params, batch_fn)  # doctest: +SKIP
      >>> result = loop.run(100)                                     # doctest: +SKIP
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        tx: Any,
        init_params: Any,
        batch_fn: Callable[[int, Layout], Any],
        *,
        step_options: dict[str, Any] | None = None,
        stall_timeout_s: float | None = 300.0,
        max_failures: int = 20,
        on_step: Callable[[StepRecord], None] | None = None,
        on_attempt: Callable[[int, Layout], None] | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
        init_model_state: Any = None,
    ) -> None:
        directory, every = _elastic_checkpoint.check_args(checkpoint_dir, checkpoint_every)
        stall_timeout_s, max_failures = _check_loop_args(
            loss_fn, tx, step_options, stall_timeout_s, max_failures, init_model_state
        )
        options = dict(step_options or {})
        inside = _inside(options)
        self._checkpoints = None
        if directory is not None and every is not None:
            self._checkpoints = _elastic_checkpoint.Checkpoints(directory, every, inside)
        self._template = (init_params, tx, init_model_state, inside)
        self._work = _TrainWork(
            loss_fn, tx, options, batch_fn, self._checkpoints, on_attempt, inside
        )
        self._on_step = on_step
        restart = _Restart(self._checkpoints, self._template) if self._checkpoints else None
        self._attempts = _attempts.Attempts(
            self._fresh, stall_timeout_s, max_failures, restart, shard_over=inside
        )
        self._step = 0

    @property
    def layout(self) -> Layout | None:
        """The membership the last committed step ran on (None before the first)."""
        return self._attempts.layout

    def _fresh(self, mesh: Mesh) -> tuple[Any, ...]:
        return _fresh_state(mesh, *self._template)

    def run(
        self,
        num_steps: int,
        *,
        first_step: int = 0,
        initial_state: tuple[Any, ...] | None = None,
    ) -> ElasticResult:
        """Trains until step ``num_steps`` through failures and rejoins.

        With ``checkpoint_dir``, a job's first ``run`` (no ``initial_state``, and no
        running job to join) resumes from the folder's newest finalized checkpoint, the
        step process 0 finds, on whatever number of processes this job has.

        Args:
          num_steps: the step to stop at (a joining process stops there too).
          first_step: the step to start from: 0, or the step of the state passed as
            ``initial_state`` (the same on every process).
          initial_state: ``(params, opt_state)`` (``(params, model_state, opt_state)``
            with model state) with a leading replica axis, this
            process's replicas on its devices over any mesh: a restored checkpoint, or a
            previous run's ``result.state`` to go on. Default: fresh
            (``init_params`` and ``tx.init``); required when this loop ran before.

        Returns:
          An :class:`ElasticResult` with this process's state and its records.

        Raises:
          SystemExit: with status 0, after one line saying so, in a process that
            (re)started after the run reached ``num_steps`` (nothing left to join).
          ValueError: a bad argument; or the checkpoint to resume from is at or past
            ``num_steps``.
          CoordinatorLostError: no live process holds the model any more and there is
            nothing to restart from (no ``checkpoint_dir``).

        Example:
          >>> first = loop.run(100)  # doctest: +SKIP
          >>> more = loop.run(200, first_step=100,  # doctest: +SKIP
          ...                 initial_state=first.state)
        """
        attempts = self._attempts
        step, state = _begin(
            attempts, self._checkpoints, self._template, num_steps, first_step, initial_state
        )
        records: list[StepRecord] = []
        while step < num_steps:
            (state, loss, aux), step, recovery, failures = attempts.retrying(
                "training step", state, step, self._work
            )
            assert self.layout is not None  # set by the attempt that succeeded
            record = _record(step, self.layout.processes, loss, recovery, failures, aux)
            records.append(record)
            attempts.records_started = True
            if self._on_step is not None:
                self._on_step(record)
            step += 1
        self._step, attempts.last_step = step, None
        if self._checkpoints is not None:
            self._checkpoints.poll()  # a failed write is an error (shutdown waits for them)
        _membership.mark_finished(step)
        assert state is not None and self.layout is not None  # num_steps >= 1 ran
        return _result(state, self.layout, records)

    def consensus(self, result: ElasticResult, *, model_state: bool = False) -> Any:
        """The mean of the live replicas' params (a collective: every live process calls
        it), retried through failures like a step.

        Args:
          result: what :meth:`run` returned.
          model_state: also the mean of the live replicas' model state (with
            ``step_options={"with_model_state": True}`` only).

        Returns:
          The params without the replica axis, on every process; with ``model_state``,
          ``(params, model_state)``.
        """
        if model_state and result.model_state is None:
            raise ValueError(
                "ElasticLoop.consensus: model_state=True, but this loop has no model "
                'state (step_options={"with_model_state": True} and init_model_state).'
            )
        out, _, _, _ = self._attempts.retrying(
            "consensus", result.state, self._step, _consensus_work(model_state)
        )
        return out

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Leaves the run cleanly (:func:`shutdown` over this loop's live processes), once
        this process's checkpoint writers in flight are done.

        Args:
          timeout_s: how long process 0 waits for the others to say they are done (when
            it hosts the coordination service).

        Returns:
          None.
        """
        if self._checkpoints is not None:
            self._checkpoints.wait()  # this process's checkpoint writers finish first
        shutdown(self.layout.processes if self.layout else (), timeout_s)
