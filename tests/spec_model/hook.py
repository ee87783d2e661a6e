"""The post-local SGD hook and the inner optimizer (SGD, momentum, Adam)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from spec_model.base import F32, Topology, Tree, group_mean, short_repr

# --- the hook -----------------------------------------------------------------------------


@short_repr
@dataclasses.dataclass(frozen=True)
class HookConfig:
    """``PostLocalSGDState(process_group, subgroup, start, post_local_gradient_allreduce)``."""

    start: int
    post_local_gradient_allreduce: bool = True
    subgroup: tuple[str, ...] | None = None  # None: ("local",)
    process_group: tuple[str, ...] | None = None  # None: every data axis


def hook_step(cfg: HookConfig, it: int, grads: Tree, topo: Topology) -> tuple[Tree, int]:
    """Rule: "If start == 0: local phase from the start. If iter < start: g <- mean of g
    over the global group, iter += 1. Else: g <- mean over the subgroup if
    post_local_gradient_allreduce else g unchanged; iter stays. Only floating leaves are
    averaged. A NaN in a mean spreads to the whole group." The hook's iter stops at start.
    """
    if cfg.start > 0 and it < cfg.start:
        groups = topo.groups(cfg.process_group)
        return {k: group_mean(g, groups) for k, g in grads.items()}, it + 1
    if not cfg.post_local_gradient_allreduce:
        return grads, it
    groups = topo.groups(cfg.subgroup if cfg.subgroup is not None else ("local",))
    return {k: group_mean(g, groups) for k, g in grads.items()}, it


def ddp_mean(grads: Tree, topo: Topology) -> Tree:
    """Rule: "Without a hook, data_parallel_step averages gradients over all data axes
    every step (DDP)"."""
    groups = topo.groups(None)
    return {k: group_mean(g, groups) for k, g in grads.items()}


# --- the inner optimizer ------------------------------------------------------------------


@short_repr
@dataclasses.dataclass(frozen=True)
class InnerConfig:
    """The local (inner) optax optimizer.

    kind: "sgd" (``optax.sgd(lr)``), "momentum" / "nesterov" (``optax.sgd(lr, momentum,
    nesterov=...)``) or "adam" (``optax.adam(lr, b1, b2, eps)``). ``grad_norm``: a
    ``grad_norm_ema`` transformation in front (a floating scalar state leaf that is not
    shaped like the params).
    """

    kind: str
    lr: float = 0.1
    momentum: float = 0.9
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_norm: bool = False


def inner_init(cfg: InnerConfig, params: Tree) -> dict[str, Any]:
    """The inner state, by component name: params-shaped parts are dicts like the params
    ("trace", "mu", "nu"); the others are per-replica arrays ("count", "gn")."""
    zeros = {k: np.zeros_like(v) for k, v in params.items()}
    n = len(next(iter(params.values())))
    state: dict[str, Any] = {}
    if cfg.grad_norm:
        state["gn"] = np.zeros(n, F32)
    if cfg.kind in ("momentum", "nesterov"):
        state["trace"] = zeros
    if cfg.kind == "adam":
        state["count"] = np.zeros(n, np.int32)
        state["mu"] = dict(zeros)
        state["nu"] = {k: v.copy() for k, v in zeros.items()}
    return state


def grad_norm_ema(gn: np.ndarray, grads: Tree) -> np.ndarray:
    """The test's own transformation: ``gn <- 0.5 * gn + sum over leaves of sum(g * g)``,
    gradients passed through."""
    total = np.zeros_like(gn)
    for g in grads.values():
        total = total + (g * g).reshape(len(g), -1).sum(axis=1, dtype=F32)
    return F32(0.5) * gn + total


def sgd_update(cfg: InnerConfig, trace: Tree | None, grads: Tree) -> tuple[Tree, Tree | None]:
    """Rule: "optax.sgd(lr) / optax.sgd(lr, momentum=m, nesterov=...): trace <- g +
    m*trace; u = -lr*(g + m*trace_new if nesterov else trace_new)"."""
    lr, m = F32(cfg.lr), F32(cfg.momentum)
    if cfg.kind == "sgd":
        return {k: -lr * g for k, g in grads.items()}, None
    new_trace = {k: g + m * trace[k] for k, g in grads.items()}
    if cfg.kind == "nesterov":
        direction = {k: g + m * new_trace[k] for k, g in grads.items()}
    else:
        direction = new_trace
    return {k: -lr * d for k, d in direction.items()}, new_trace


def adam_update(cfg: InnerConfig, state: dict, grads: Tree) -> tuple[Tree, dict]:
    """optax.adam: mu <- (1-b1) g + b1 mu; nu <- (1-b2) g^2 + b2 nu; count += 1;
    u = -lr * (mu / (1 - b1^count)) / (sqrt(nu / (1 - b2^count)) + eps)."""
    b1, b2 = F32(cfg.b1), F32(cfg.b2)
    mu = {k: (F32(1) - b1) * g + b1 * state["mu"][k] for k, g in grads.items()}
    nu = {k: (F32(1) - b2) * (g * g) + b2 * state["nu"][k] for k, g in grads.items()}
    count = state["count"] + 1
    c1 = (1 - np.float64(cfg.b1) ** count).astype(F32)
    c2 = (1 - np.float64(cfg.b2) ** count).astype(F32)
    updates = {}
    with np.errstate(invalid="ignore"):
        for k in grads:
            shape = (-1,) + (1,) * (grads[k].ndim - 1)
            mu_hat = mu[k] / c1.reshape(shape)
            nu_hat = nu[k] / c2.reshape(shape)
            updates[k] = -F32(cfg.lr) * (mu_hat / (np.sqrt(nu_hat) + F32(cfg.eps)))
    return updates, {"count": count, "mu": mu, "nu": nu}


def inner_update(cfg: InnerConfig, state: dict, grads: Tree) -> tuple[Tree, dict]:
    """One step of the inner optimizer on every replica: ``(updates, new_state)``."""
    state = dict(state)
    with np.errstate(invalid="ignore", over="ignore"):
        if cfg.grad_norm:
            state["gn"] = grad_norm_ema(state["gn"], grads)
        if cfg.kind == "adam":
            updates, adam = adam_update(cfg, state, grads)
            state.update(adam)
        else:
            updates, trace = sgd_update(cfg, state.get("trace"), grads)
            if trace is not None:
                state["trace"] = trace
    return updates, state
