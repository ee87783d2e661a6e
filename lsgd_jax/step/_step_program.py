"""The compiled programs behind data_parallel_step: one step, in one of three forms.

One step, per replica: gradients of the loss -> (no hook: their mean over every replica,
DDP) -> ``tx.update`` (hook, optimizer, averager) -> ``apply_updates`` -> model state
averaged with the params -> the mean loss and reduced aux. It is compiled as

- one program per *phase* (``mode`` an int): every hook and averager pinned to its
  branch (``_phase.pin``), so the whole step is straight-line code, as fast as a
  hand-written step (the gradient collectives overlap the backward pass). The program
  checks on the device that the state really is in that phase and, if not, returns its
  inputs unchanged with ``ok`` false (a wrong choice costs a step, never corrupts);
- one program with the whole step traced once per phase under one ``lax.switch``
  (``"switch"``): fast at run time too, but compiled for every phase at once;
- one program with each transform's own ``lax.cond`` (``"cond"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lsgd_jax._core import _collectives, _fsdp, _leaves
from lsgd_jax._core import _state_protocol as sp
from lsgd_jax._core._replicas import num_replicas
from lsgd_jax.averaging import ModelAveragerState
from lsgd_jax.step import _pairing, _phase, _preflight

MAX_PHASES = 16


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
    return cast(list[ModelAveragerState], sp.states(opt_state, sp.AVERAGER))


def check_optimizer(opt_state: Any, check_order: bool = True, tx: Any = None) -> None:
    """How the chain's pieces fit (see check_configuration), and a chain without a hook."""
    _pairing.check_configuration(opt_state, check_order=check_order, tx=tx)
    if not _pairing.has_hook(opt_state) and averager_states(opt_state):
        raise ValueError(
            "data_parallel_step: the optimizer averages models but has no post_local_sgd "
            "hook, so the step would average gradients over every replica (DDP) and the "
            "replicas would never differ. For post-local SGD put lsgd_jax.post_local_sgd("
            "start_localSGD_iter) first in the chain; for local SGD without any gradient "
            "averaging, lsgd_jax.post_local_sgd(0, post_local_gradient_allreduce=False)."
        )


def check_when_built(spec: StepSpec, example_params: Any = None) -> None:
    """What can be checked before the first step (``_preflight``): the chain's order,
    every phase's groups and collectives on the mesh, and a chain that averages models
    without a hook; on ``example_params`` (one replica's params or their abstract
    shapes) if given, else on a stand-in, leaving what depends on the model's shapes to
    :func:`check_at_first_call`. A ``tx`` whose init cannot init the stand-in is
    checked at the first call.
    """
    what = "data_parallel_step"
    if example_params is not None:
        _leaves.refuse_non_floating(example_params, what)
    state = _preflight.check_tx(
        spec.tx, spec.mesh, spec.axes, what, spec.check_order, example_params
    )
    if state is not None:
        check_optimizer(state, spec.check_order, spec.tx)


def check_at_first_call(spec: StepSpec, params: Any, opt_state: Any, checked: Any = None) -> None:
    """The build check again on the params and optimizer state of the first call
    (per-replica, abstract shapes are enough), before any step runs; ``checked``: the
    signature (``_preflight.signature``) of one replica's params it ran on when the
    step was built (from ``example_params``), for which it is not run again."""
    _leaves.refuse_non_floating(params, "data_parallel_step")  # jax.grad needs floats
    if checked is not None and _preflight.signature(_preflight.one_replica(params)) == checked:
        return
    _preflight.check_model(
        spec.tx, spec.mesh, spec.axes, "data_parallel_step", spec.check_order, params, opt_state
    )


def _average_like_params(model_state: Any, opt_state: Any, new_opt_state: Any) -> Any:
    """Averages ``model_state`` on the steps (and over the group) the params averaged.

    Only where the averager really ran: a wrapper such as ``optax.MultiSteps`` or
    ``optax.apply_if_finite`` can keep the inner state (and so the averager's step) as it
    was, and then the params did not average either. A group whose params' average was
    skipped (a non-finite policy) keeps its model state too; see
    ``lsgd_jax.averaging.like_params``.
    """
    from lsgd_jax.averaging import like_params  # noqa: PLC0415

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
    ran = after.counter != state.counter

    def average(tree):
        return like_params(state.averager, tree, state, after)

    if state.pinned_phase is None:
        return lax.cond(ran, average, lambda tree: tree, model_state)
    # A phase program keeps every collective out of conditionals: XLA:CPU may start a
    # collective that follows a conditional (the metrics' mean) before the one inside
    # it, on some devices and not others, and with every worker thread waiting in one of
    # the two the step deadlocks (seen in CI: 5 devices in the global mean, 3 in their
    # node's). The mean is taken as the phase says and dropped where the averager did not
    # run (an optax wrapper such as MultiSteps skipped it): bytes spent only there.
    return _collectives.cast_like(
        _collectives.select(ran, average(model_state), model_state), model_state
    )


def _metrics_mean(tree: Any, axes: tuple[str, ...]) -> Any:
    def one(x):
        reduce = lax.pmean if _collectives.is_averaged(x) else lax.psum
        return _collectives.all_reduce(reduce, x, axes)

    return jax.tree.map(one, tree)


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What a step computes: the user's loss and optimizer, on which mesh and axes."""

    loss_fn: Callable[..., Any]
    tx: Any
    mesh: Mesh
    axes: tuple[str, ...]
    has_aux: bool
    with_model_state: bool
    donate: bool
    lowering: str = "shard_map"
    fsdp_axes: tuple[str, ...] = ()
    compiler_options: tuple[tuple[str, Any], ...] = ()  # jax.jit's, as sorted items
    check_order: bool = True  # refuse a hook not first / an averaging not last

    def gradients(self, params: Any, model_state: Any, batch: Any) -> tuple:
        """``(loss, aux, grads, new model state)`` of this replica's loss.

        With FSDP axes the replica's params and model state are gathered for the loss,
        its rows split over those axes, and the gradients (and new model state) reduced
        back onto their shards.
        """
        if self.fsdp_axes:
            loss, aux, grads, model_state = self._gradients(
                _fsdp.gather(params),
                _fsdp.gather(model_state),
                _fsdp.split_rows(batch, self.fsdp_axes),
            )
            back = (grads, model_state)
            grads, model_state = _fsdp.scatter(back, self.mesh, self.fsdp_axes)
            return loss, aux, grads, model_state
        return self._gradients(params, model_state, batch)

    def _gradients(self, params: Any, model_state: Any, batch: Any) -> tuple:
        value_and_grad = jax.value_and_grad(
            self.loss_fn, has_aux=self.has_aux or self.with_model_state
        )
        aux = None
        if self.with_model_state:
            (loss, out), grads = value_and_grad(params, model_state, batch)
            model_state, aux = out if self.has_aux else (out, None)
        elif self.has_aux:
            (loss, aux), grads = value_and_grad(params, batch)
        else:
            loss, grads = value_and_grad(params, batch)
        return loss, aux, grads, model_state

    def update(self, operands: tuple, phase: int | None) -> tuple:
        """One replica's update from its gradients: ``(params, model_state, opt_state)``
        after ``tx``, every state pinned to ``phase`` (None: no pin)."""
        params, model_state, opt_state, grads = operands
        if not _pairing.has_hook(opt_state):  # no post_local_sgd: DDP
            with jax.named_scope("ddp"):
                grads = _collectives.mean(grads, self.axes)
        if phase is not None:
            opt_state = _phase.pin(opt_state, phase)
        updates, new_opt_state = self.tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if self.with_model_state:
            model_state = _average_like_params(model_state, opt_state, new_opt_state)
        return params, model_state, _phase.unpin(new_opt_state)

    def whole_step(self, operands: tuple, phase: int | None) -> tuple:
        """One replica's step: gradients, then :meth:`update`; and the loss and aux."""
        params, model_state, opt_state, batch = operands
        loss, aux, grads, model_state = self.gradients(params, model_state, batch)
        out = self.update((params, model_state, opt_state, grads), phase)
        return (*out, loss, aux)


def _computed_once(pred: jax.Array) -> jax.Array:
    """``pred``, computed once and handed to its consumers as a value.

    XLA duplicates cheap scalar producers into every fusion that consumes them: the
    phase guard's counter arithmetic (remainders, floor divisions, selects: ~9 ops) was
    copied into the fusion of each state leaf the guard selects, 1,770 compares and
    1,768 selects in a 64-leaf program (2.4x the HLO of a hand-written step). A
    conditional is not fusible, so its result reaches each fusion as one parameter.
    (``lax.optimization_barrier`` does not survive XLA:CPU's pipeline to fusion.)
    """
    return lax.cond(pred, lambda: jnp.bool_(True), lambda: jnp.bool_(False))


def _switch_over_phases(work: Callable[..., tuple], operands: tuple, axes: frozenset) -> tuple:
    """``work`` traced once per phase, under one ``lax.switch`` on the counters."""
    opt_state = operands[2]

    def branch(k):
        def run(*ops):
            out = work(ops, k)
            # every branch returns per-replica values: type them all alike
            return jax.tree.map(lambda x: _collectives.cast_varying(x, axes), out)

        return run

    branches = [branch(k) for k in range(_phase.num_phases(opt_state))]
    return lax.switch(_phase.phase_index(opt_state), branches, *operands)


def _replica_body(spec: StepSpec, mode: int | str, work: Callable[..., tuple]) -> Callable:
    """The per-replica body of a ``shard_map`` over the data axes, for ``mode``.

    ``work(operands, phase) -> (params, model_state, opt_state, loss, aux)``, where
    ``operands`` is ``(params, model_state, opt_state, x)`` of one replica (the leading
    replica axis squeezed off params, model state and optimizer state).
    """
    axes = frozenset(spec.axes)

    def body(params, model_state, opt_state, *rest):
        params, model_state, opt_state = jax.tree.map(
            lambda x: x[0], (params, model_state, opt_state)
        )
        check_optimizer(opt_state, spec.check_order, spec.tx)
        operands = (params, model_state, opt_state, *rest)
        n = _phase.num_phases(opt_state)
        ok = jnp.ones([], bool)
        if isinstance(mode, int):
            *new, loss, aux = work(operands, mode)
            ok = _computed_once(_phase.phase_index(opt_state) == mode)
            out = _collectives.select(ok, tuple(new), (params, model_state, opt_state))
        elif mode == "switch" and 1 < n <= MAX_PHASES:
            *out, loss, aux = _switch_over_phases(work, operands, axes)
        else:
            *out, loss, aux = work(operands, None)
        out = jax.tree.map(lambda x: x[None], tuple(out))
        with jax.named_scope("metrics"):
            loss = _collectives.all_reduce(lax.pmean, loss, spec.axes)
            aux = _metrics_mean(aux, spec.axes)
        return (*out, loss, aux, _collectives.cast_varying(ok, axes)[None])

    return body


def program(spec: StepSpec, mode: int | str) -> Any:
    """The jitted step ``(params, model_state, opt_state, batch) -> (params, model_state,
    opt_state, loss, aux, ok)`` for ``mode``: a phase (int), ``"switch"`` or ``"cond"``.

    ``ok`` (one bool per replica) is false where a phase program met a state in another
    phase; it then returned its inputs unchanged. With ``spec.lowering == "jit"`` the
    user's loss runs under plain ``jax.jit``, mapped over the replica axis, and only the
    update (whose collectives need the data axes bound) runs in a ``shard_map``.
    """
    rep = P(spec.axes)
    manual = frozenset(spec.axes)
    kwargs: dict[str, Any] = (
        {} if manual == frozenset(spec.mesh.axis_names) else {"axis_names": manual}
    )
    donate = (0, 1, 2) if spec.donate else ()
    options = dict(spec.compiler_options) or None
    if spec.lowering == "shard_map":
        mapped = jax.shard_map(
            _replica_body(spec, mode, spec.whole_step),
            mesh=spec.mesh,
            in_specs=(rep, rep, rep, rep),
            out_specs=(rep, rep, rep, P(), P(), rep),
            **kwargs,
        )
        return jax.jit(mapped, donate_argnums=donate, compiler_options=options)

    def update(operands, phase):
        params, model_state, opt_state, grads, loss, aux = operands
        grads = jax.tree.map(lambda x: x[0], grads)
        out = spec.update((params, model_state, opt_state, grads), phase)
        return (*out, loss[0], jax.tree.map(lambda x: x[0], aux))

    mapped_update = jax.shard_map(
        _replica_body(spec, mode, update),
        mesh=spec.mesh,
        in_specs=(rep,) * 6,
        out_specs=(rep, rep, rep, P(), P(), rep),
        **kwargs,
    )

    def step(params, model_state, opt_state, batch):
        n = num_replicas(spec.mesh, spec.axes)
        per_replica = jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch)
        replicas = NamedSharding(spec.mesh, rep)
        if _preflight.explicit_axes(spec.mesh, spec.axes):  # sharding in the types
            per_replica = jax.sharding.reshard(per_replica, replicas)
        else:
            per_replica = jax.lax.with_sharding_constraint(per_replica, replicas)
        loss, aux, grads, model_state = jax.vmap(spec.gradients)(params, model_state, per_replica)
        return mapped_update(params, model_state, opt_state, grads, loss, aux)

    return jax.jit(step, donate_argnums=donate, compiler_options=options)
