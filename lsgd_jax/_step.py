"""data_parallel_step: a per-replica loss function into a jitted post-local SGD step."""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lsgd_jax import _collectives, _pairing, _phase, _validate
from lsgd_jax._averager_state import ModelAveragerState
from lsgd_jax._mesh import _num_replicas, data_axes
from lsgd_jax._sync import assert_replicas_in_sync


def averager_states(opt_state: Any) -> list[ModelAveragerState]:
    """The ModelAveragerStates inside an optimizer state (e.g. of ``model_averaging``).

    Args:
      opt_state: any optax state.

    Returns:
      The list of ModelAveragerState nodes, in tree order.

    Example:
      >>> import optax, lsgd_jax
      >>> tx = optax.chain(optax.sgd(0.1),
      ...                  lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(4)))
      >>> [s.averager.period for s in lsgd_jax.averager_states(tx.init({}))]
      [4]
    """
    is_state = lambda x: isinstance(x, ModelAveragerState)  # noqa: E731
    return [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]


def _average_like_params(model_state: Any, opt_state: Any, new_opt_state: Any) -> Any:
    """Averages ``model_state`` on the steps (and over the group) the params averaged.

    Only where the averager really ran: a wrapper such as ``optax.MultiSteps`` or
    ``optax.apply_if_finite`` can keep the inner state (and so the averager's step) as it
    was, and then the params did not average either.
    """
    states = averager_states(opt_state)
    if not states:
        return model_state
    if len(states) > 1:
        raise ValueError(
            f"data_parallel_step: the optimizer holds {len(states)} model averagers; with "
            "model state there must be at most one, to know when to average it."
        )
    (state,) = states
    (after,) = averager_states(new_opt_state)
    return lax.cond(
        after.step != state.step,
        lambda tree: state.averager.average_alongside(tree, state),
        lambda tree: tree,
        model_state,
    )


MAX_PHASES = 16


def _update(tx: Any, with_model_state: bool, operands: tuple) -> tuple:
    """The optimizer's update and its application: the part that depends on the phase."""
    params, model_state, opt_state, grads = operands
    updates, new_opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    if with_model_state:
        model_state = _average_like_params(model_state, opt_state, new_opt_state)
    return params, model_state, new_opt_state


def _update_per_phase(tx: Any, with_model_state: bool, operands: tuple, axes: frozenset):
    """One ``lax.switch`` over the phases, each branch the update with the states pinned.

    The gradients come in computed (once, outside the switch): only the update, the
    collectives and their application are traced per phase.
    """
    opt_state = operands[2]

    def branch(k):
        def run(params, model_state, opt_state, grads):
            pinned = (params, model_state, _phase.pin(opt_state, k), grads)
            params, model_state, new_opt_state = _update(tx, with_model_state, pinned)
            out = (params, model_state, _phase.unpin(new_opt_state))
            # every branch returns per-replica values: type them all alike
            return jax.tree.map(lambda x: _collectives.cast_varying(x, axes), out)

        return run

    n = _phase.num_phases(opt_state)
    return lax.switch(_phase.phase_index(opt_state), [branch(k) for k in range(n)], *operands)


def _check_optimizer(opt_state: Any) -> None:
    """How the chain's pieces fit (see check_configuration), and a chain without a hook."""
    _pairing.check_configuration(opt_state)
    if not _pairing.has_hook(opt_state) and averager_states(opt_state):
        raise ValueError(
            "data_parallel_step: the optimizer averages models but has no post_local_sgd "
            "hook, so the step would average gradients over every replica (DDP) and the "
            "replicas would never differ. For post-local SGD put lsgd_jax.post_local_sgd("
            "start_localSGD_iter) first in the chain; for local SGD without any gradient "
            "averaging, lsgd_jax.post_local_sgd(0, post_local_gradient_allreduce=False)."
        )


def _metrics_mean(tree: Any, axes: tuple[str, ...]) -> Any:
    def one(x):
        if _collectives.is_averaged(x):
            return lax.pmean(x, axes)
        return lax.psum(x, axes)

    return jax.tree.map(one, tree)


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


def _check_batch(batch: Any, n: int, mesh: Mesh, axes: tuple[str, ...]) -> None:
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = jnp.shape(x)
        if not shape or shape[0] % n:
            raise ValueError(
                f"data_parallel_step: batch leaf {_path_name(path)} has shape {shape}; its "
                f"leading (batch) axis must divide by the {n} replicas. Use a global batch "
                f"size that is a multiple of {n}."
            )
        if jax.process_count() > 1 and not (
            isinstance(x, jax.Array) and not x.is_fully_addressable
        ):
            warnings.warn(
                f"data_parallel_step: batch leaf {_path_name(path)} is a host-local array "
                f"on a run of {jax.process_count()} processes, so it is taken as the GLOBAL "
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
    specialize: bool = True,
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
      specialize: compute the gradients once, then run the update (the hook's
        collective, the optimizer, the averager's collective, applying the updates)
        under ONE ``lax.switch`` over the phases (global or node-local gradient mean,
        times each averaging level), each branch traced with every state pinned to its
        phase (:func:`phase_index`), instead of a ``lax.cond`` per transform: each
        branch is then straight-line code that XLA fuses like a hand-written step (the
        conds cost 12-30% of a 10M-parameter step on CPU; see benchmarks/overhead.py).
        The math is the same; the pin is static metadata of the states, so a
        ``jax.jit`` or ``jax.checkpoint`` around ``tx.update`` traces each phase
        apart. At most ``MAX_PHASES`` (16) phases, else it falls back to the conds. A
        collective's ``branch`` in :func:`communication_report` is the phase index.
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
    n = _num_replicas(mesh, axes)
    check_in_sync_every = _validate.optional_positive_int(
        check_in_sync_every, "data_parallel_step: check_in_sync_every"
    )
    max_in_flight = _validate.optional_positive_int(
        max_in_flight, "data_parallel_step: max_in_flight"
    )
    rep = P(axes)
    value_and_grad = jax.value_and_grad(loss_fn, has_aux=has_aux or with_model_state)

    def gradients(params, model_state, batch):
        aux = None
        if with_model_state:
            (loss, out), grads = value_and_grad(params, model_state, batch)
            model_state, aux = out if has_aux else (out, None)
        elif has_aux:
            (loss, aux), grads = value_and_grad(params, batch)
        else:
            loss, grads = value_and_grad(params, batch)
        return loss, aux, grads, model_state

    def body(params, model_state, opt_state, batch):
        params, model_state, opt_state = jax.tree.map(
            lambda x: x[0], (params, model_state, opt_state)
        )
        _check_optimizer(opt_state)
        loss, aux, grads, model_state = gradients(params, model_state, batch)
        if not _pairing.has_hook(opt_state):  # no post_local_sgd: DDP
            with jax.named_scope("ddp"):
                grads = _collectives.mean(grads, axes)
        operands = (params, model_state, opt_state, grads)
        if specialize and 1 < _phase.num_phases(opt_state) <= MAX_PHASES:
            out = _update_per_phase(tx, with_model_state, operands, frozenset(axes))
        else:
            out = _update(tx, with_model_state, operands)
        out = jax.tree.map(lambda x: x[None], out)
        with jax.named_scope("metrics"):
            loss, aux = lax.pmean(loss, axes), _metrics_mean(aux, axes)
        return (*out, loss, aux)

    manual = frozenset(axes)
    kwargs = {} if manual == frozenset(mesh.axis_names) else {"axis_names": manual}
    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(rep, rep, rep, rep),
        out_specs=(rep, rep, rep, P(), P()),
        **kwargs,
    )
    jitted = jax.jit(mapped, donate_argnums=(0, 1, 2) if donate else ())

    def check(params, model_state, opt_state, batch):
        _check_replicated(params, "params", n, mesh, axes)
        _check_replicated(opt_state, "opt_state", n, mesh, axes)
        if with_model_state:
            _check_replicated(model_state, "model_state", n, mesh, axes)
        _check_batch(batch, n, mesh, axes)

    return DataParallelStep(
        jitted,
        check,
        with_model_state=with_model_state,
        has_aux=has_aux,
        max_in_flight=max_in_flight,
        check_in_sync_every=check_in_sync_every,
    )


class DataParallelStep:
    """The training step that :func:`data_parallel_step` builds.

    Call it as ``step(params, opt_state, batch)`` (or ``step(params, model_state,
    opt_state, batch)`` with model state); see :func:`data_parallel_step` for what it
    returns. ``step.communication_report(params, opt_state, batch)`` (or
    ``lsgd_jax.communication_report(step, params, opt_state, batch)``) lists what it
    communicates, compiled for those arguments without running it.

    Attributes:
      jitted: the underlying ``jax.jit`` function, with the signature ``(params,
        model_state, opt_state, batch) -> (params, model_state, opt_state, loss, aux)``
        (``model_state`` and ``aux`` None where unused).
      with_model_state: whether the step takes and returns model state.
      has_aux: whether the step returns ``aux``.
    """

    def __init__(
        self,
        jitted: Any,
        check: Callable[..., None],
        *,
        with_model_state: bool,
        has_aux: bool,
        max_in_flight: int | None,
        check_in_sync_every: int | None,
    ) -> None:
        self.jitted = jitted
        self.with_model_state = with_model_state
        self.has_aux = has_aux
        self._check = check
        self._max_in_flight = max_in_flight
        self._check_in_sync_every = check_in_sync_every
        self._in_flight: collections.deque = collections.deque()
        self._calls = 0

    def jit_args(self, *args: Any) -> tuple[Any, Any, Any, Any]:
        """``(params, model_state, opt_state, batch)`` for :attr:`jitted` from the step's
        own arguments (``model_state`` None without model state)."""
        names = ("params", "model_state", "opt_state", "batch")
        if not self.with_model_state:
            names = ("params", "opt_state", "batch")
        if len(args) != len(names):
            raise TypeError(
                f"data_parallel_step: the step takes ({', '.join(names)}), got {len(args)} "
                "arguments."
            )
        if self.with_model_state:
            return args  # type: ignore[return-value]
        params, opt_state, batch = args
        return params, None, opt_state, batch

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        params, model_state, opt_state, batch = self.jit_args(*args)
        every = self._check_in_sync_every
        if every is not None and self._calls % every == 0:
            assert_replicas_in_sync(opt_state)
        self._calls += 1
        self._check(params, model_state, opt_state, batch)
        params, model_state, opt_state, loss, aux = self.jitted(
            params, model_state, opt_state, batch
        )
        if self._max_in_flight is not None:
            self._in_flight.append(loss)
            if len(self._in_flight) > self._max_in_flight:
                self._in_flight.popleft().block_until_ready()
        out = (params, model_state, opt_state, loss) if self.with_model_state else None
        out = out or (params, opt_state, loss)
        return out + ((aux,) if self.has_aux else ())

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
