"""A run: configs, batches, the loss, and the step-by-step replay (``simulate``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from spec_model.averagers import (
    Averaged,
    AveragerConfig,
    AveragerState,
    average_call,
    average_model_state,
    averager_init,
)
from spec_model.base import F32, TRAINABLE, Snapshot, Topology, Tree, is_floating, short_repr
from spec_model.hook import HookConfig, InnerConfig, ddp_mean, hook_step, inner_init, inner_update

# --- a run --------------------------------------------------------------------------------


@short_repr
@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One run of the library, in one of the four ways of calling it.

    path: "functional" (hook -> inner -> apply_updates -> average_parameters in a
    shard_map), "model_averaging" (``optax.chain(hook, inner, model_averaging)``),
    "optimizer" (``optax.chain(hook, post_local_sgd_optimizer(inner, averager, ...))``)
    or "step" (``data_parallel_step`` of the chain ``step_tx``).
    hook: None for none (``data_parallel_step`` then averages gradients, DDP).
    averager: None for none (``step`` only).
    opt_state_mask: "none", "all" (a tree of True) or "arrays" (a callable: every leaf
    with ndim > 0): which inner-state leaves ``post_local_sgd_optimizer`` averages.
    step_tx: for "step": "model_averaging", "optimizer" or "inner" (no averager).
    multi_steps: for "step": ``optax.MultiSteps(chain, every_k_schedule=k)`` when > 1.
    model_state: for "step": ``with_model_state=True``.
    int_leaf / complex_leaf: for "functional": an int32 and a complex64 params leaf,
    moved by the test itself, never by the optimizer.
    specialize / lowering: for "step": how ``data_parallel_step`` compiles the step;
    the documented numbers are the same for every choice, so the model ignores them.
    """

    topo: Topology
    path: str
    hook: HookConfig | None
    inner: InnerConfig
    averager: AveragerConfig | None
    opt_state_mask: str = "none"
    step_tx: str = ""
    multi_steps: int = 1
    model_state: bool = False
    int_leaf: bool = False
    complex_leaf: bool = False
    specialize: bool | str = True
    lowering: str = "shard_map"


@dataclasses.dataclass
class Batch:
    """One step's data, per replica: the loss is ``0.5 * sum(c * (w - d)**2)`` summed over
    the float leaves (gradient ``c * (w - d)``); ``e`` feeds the model state; ``n_inc`` and
    ``z_inc`` move the int and complex leaves of the functional path."""

    c: Tree
    d: Tree
    e: np.ndarray
    n_inc: np.ndarray
    z_inc: np.ndarray


def gradients(params: Tree, batch: Batch) -> Tree:
    """Rule: "Gradients g_r of a simple per-replica loss at its params": c * (w - d)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return {k: batch.c[k] * (params[k] - batch.d[k]) for k in batch.c}


def loss_value(params: Tree, batch: Batch) -> np.float32:
    """The loss ``data_parallel_step`` returns: the mean over replicas of each replica's
    ``sum over leaves of 0.5 * sum(c * (w - d)**2)``."""
    with np.errstate(invalid="ignore", over="ignore"):
        per = 0.0
        for k in batch.c:
            diff = params[k].astype(np.float64) - batch.d[k]
            per = per + 0.5 * (batch.c[k] * diff**2).reshape(len(diff), -1).sum(axis=1)
        return F32(np.mean(per))


def model_state_step(model_state: Tree, batch: Batch) -> Tree:
    """The test's model state, updated inside loss_fn from the batch: ``stat <- 0.5 *
    stat + e`` (float32), ``count <- count + 1`` (int32, never averaged)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return {
            "count": model_state["count"] + np.int32(1),
            "stat": F32(0.5) * model_state["stat"] + batch.e,
        }


def chosen_components(cfg: RunConfig, inner_state: dict) -> dict[str, Any]:
    """The inner-state components that ``average_opt_state`` selects: "all": every one;
    "arrays": those whose leaves have ndim > 0 (the params-shaped ones)."""
    if cfg.path not in ("optimizer", "step") or cfg.opt_state_mask == "none":
        return {}
    if cfg.path == "step" and cfg.step_tx != "optimizer":
        return {}
    if cfg.opt_state_mask == "all":
        return dict(inner_state)
    return {k: v for k, v in inner_state.items() if isinstance(v, dict)}


@dataclasses.dataclass
class Replay:
    """Everything the model carries from step to step."""

    params: Tree
    hook_iter: int
    inner: dict
    averager: AveragerState | None
    model_state: Tree
    acc: Tree | None = None
    mini_step: int = 0
    gradient_step: int = 0


def _chain_step(cfg: RunConfig, rp: Replay, grads: Tree) -> tuple[Tree, Replay, Averaged | None]:
    """hook -> inner -> averager, as ``model_averaging`` / ``post_local_sgd_optimizer``
    see it: returns the params after ``apply_updates`` and the next states.

    Rule (paths): "model_averaging / post_local_sgd_optimizer instead turn the update into
    u' = new - p so that apply_updates gives p + (new - p) ... On non-averaging or skipped
    steps u passes unchanged"; chosen inner-state leaves are "assigned the mean (not via
    updates)".
    """
    rp = dataclasses.replace(rp)
    if cfg.hook is not None:
        grads, rp.hook_iter = hook_step(cfg.hook, rp.hook_iter, grads, cfg.topo)
    updates, rp.inner = inner_update(cfg.inner, rp.inner, grads)
    p = rp.params
    with np.errstate(invalid="ignore", over="ignore"):
        stepped = {k: (p[k] + updates[k]).astype(p[k].dtype) for k in p}
        if rp.averager is None:
            return stepped, rp, None
        chosen = chosen_components(cfg, rp.inner)
        avg, rp.averager = average_call(cfg.averager, rp.averager, stepped, cfg.topo, chosen)
        new_params = {}
        for k in p:
            via_updates = p[k] + (avg.params[k] - p[k])
            new_params[k] = np.where(avg.assigned[k], via_updates, stepped[k]).astype(p[k].dtype)
    rp.inner = {**rp.inner, **avg.extra}
    return new_params, rp, avg


def _snapshot(cfg: RunConfig, rp: Replay, loss: Any) -> Snapshot:
    """The observable state after a step, by the names the tests read back."""
    snap: Snapshot = {f"params/{k}": v.copy() for k, v in rp.params.items()}
    if cfg.hook is not None:
        snap["hook/iter"] = np.full(cfg.topo.size, rp.hook_iter, np.int32)
    for name, c in rp.inner.items():
        if isinstance(c, dict):
            snap.update({f"inner/{name}/{k}": v.copy() for k, v in c.items()})
        else:
            snap[f"inner/{name}"] = c.copy()
    if rp.averager is not None:
        a, acfg = rp.averager, cfg.averager
        snap["averager/step"] = np.full(cfg.topo.size, a.step, np.int32)
        if a.anchor is not None:
            for k, v in a.anchor.items():
                if is_floating(v):
                    snap[f"averager/anchor/{k}"] = v.copy()
        if acfg.outer is not None:
            snap["averager/outer_count"] = a.outer_count.copy()
            if a.outer_trace is not None:
                snap.update(
                    {f"averager/outer_trace/{k}": v.copy() for k, v in a.outer_trace.items()}
                )
        for name in ("residual", "inflight_start", "inflight_mean"):
            tree = getattr(a, name)
            if tree is not None:
                snap.update(
                    {f"averager/{name}/{k}": v.copy() for k, v in tree.items() if is_floating(v)}
                )
        if isinstance(acfg.period, str) and acfg.kind == "periodic":
            snap["averager/last_sync"] = np.full(cfg.topo.size, a.last_sync, np.int32)
    if cfg.model_state:
        snap.update({f"model_state/{k}": v.copy() for k, v in rp.model_state.items()})
    if cfg.multi_steps > 1:
        snap["multi_steps/mini_step"] = np.full(cfg.topo.size, rp.mini_step, np.int32)
        snap["multi_steps/gradient_step"] = np.full(cfg.topo.size, rp.gradient_step, np.int32)
    if loss is not None:
        snap["loss"] = np.asarray(loss, F32)
    return snap


def initial_replay(cfg: RunConfig, params0: Tree, model_state0: Tree | None = None) -> Replay:
    """Every replica starts from the same params; all counters at 0."""
    n = cfg.topo.size
    params = {k: np.broadcast_to(v, (n, *v.shape)).copy() for k, v in params0.items()}
    trainable = {k: v for k, v in params.items() if k in TRAINABLE}
    averager = averager_init(cfg.averager, params) if cfg.averager is not None else None
    ms = model_state0 or {"count": np.zeros((), np.int32), "stat": np.zeros(2, F32)}
    ms = {k: np.broadcast_to(v, (n, *np.shape(v))).copy() for k, v in ms.items()}
    acc = {k: np.zeros_like(v) for k, v in trainable.items()} if cfg.multi_steps > 1 else None
    return Replay(params, 0, inner_init(cfg.inner, trainable), averager, ms, acc)


def simulate(cfg: RunConfig, params0: Tree, batches: list[Batch]) -> tuple[list[Snapshot], list]:
    """Replays the run; returns one Snapshot per step, and per step the groups that
    ``average_parameters`` assigned (functional path: bitwise-identical members)."""
    rp = initial_replay(cfg, params0)
    snaps, assigned = [], []
    for batch in batches:
        train = {k: v for k, v in rp.params.items() if k in batch.c}
        loss = loss_value(train, batch) if cfg.path == "step" else None
        grads = gradients(train, batch)
        avg = None
        if cfg.path == "functional":
            rp, avg = _functional_step(cfg, rp, grads, batch)
        elif cfg.path in ("model_averaging", "optimizer"):
            rp, avg = _updates_step(cfg, rp, grads)
        else:
            rp, avg = _data_parallel_step(cfg, rp, grads, batch)
        snaps.append(_snapshot(cfg, rp, loss))
        assigned.append(avg.bitwise_groups if avg is not None else [])
    return snaps, assigned


def _functional_step(cfg: RunConfig, rp: Replay, grads: Tree, batch: Batch):
    """Path (a): hook -> inner update -> optax.apply_updates -> average_parameters, which
    "ASSIGNS the mean (bitwise-identical replicas)". The int leaf grows by ``n_inc`` and
    the complex leaf by ``z_inc`` before the average."""
    rp = dataclasses.replace(rp)
    grads, rp.hook_iter = hook_step(cfg.hook, rp.hook_iter, grads, cfg.topo)
    updates, rp.inner = inner_update(cfg.inner, rp.inner, grads)
    p = dict(rp.params)
    with np.errstate(invalid="ignore", over="ignore"):
        for k in updates:
            p[k] = (p[k] + updates[k]).astype(p[k].dtype)
    if "n" in p:
        p["n"] = p["n"] + batch.n_inc
    if "z" in p:
        p["z"] = (p["z"] + batch.z_inc).astype(np.complex64)
    avg, rp.averager = average_call(cfg.averager, rp.averager, p, cfg.topo)
    rp.params = avg.params
    return rp, avg


def _updates_step(cfg: RunConfig, rp: Replay, grads: Tree):
    """Paths (b) and (c): the chain, then ``optax.apply_updates``."""
    params, rp, avg = _chain_step(cfg, rp, grads)
    rp.params = params
    return rp, avg


def _data_parallel_step(cfg: RunConfig, rp: Replay, grads: Tree, batch: Batch):
    """Path (d): ``data_parallel_step``: DDP gradient mean when there is no hook; the
    chain (under MultiSteps: accumulate, and the chain "only takes effect on every k-th
    mini-step"); model state averaged where the averager really averaged."""
    rp = dataclasses.replace(rp)
    if cfg.hook is None:
        grads = ddp_mean(grads, cfg.topo)
    new_ms = model_state_step(rp.model_state, batch)
    avg = None
    if cfg.multi_steps > 1:
        emit = rp.mini_step == cfg.multi_steps - 1
        n = F32(rp.mini_step + 1)
        acc = {k: rp.acc[k] + (g - rp.acc[k]) / n for k, g in grads.items()}
        if emit:
            params, rp, avg = _chain_step(cfg, rp, acc)
            rp.params = params
            rp.acc = {k: np.zeros_like(v) for k, v in acc.items()}
            rp.gradient_step += 1
        else:
            rp.acc = acc  # nothing took effect on this mini-step: avg stays None
        rp.mini_step = (rp.mini_step + 1) % cfg.multi_steps
    else:
        params, rp, avg = _chain_step(cfg, rp, grads)
        rp.params = params
    if cfg.averager is not None:
        new_ms = average_model_state(cfg.averager, avg, new_ms)
    rp.model_state = new_ms
    return rp, avg
