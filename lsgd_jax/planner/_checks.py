"""What ``lsgd_jax.plan`` checks of its inputs before it measures anything."""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import Mesh

from lsgd_jax import averaging, hook
from lsgd_jax.planner._candidates import CANDIDATES, Candidate


def checked_candidates(candidates: Any) -> tuple[Candidate, ...]:
    if isinstance(candidates, Candidate) or not isinstance(candidates, (list, tuple)):
        raise TypeError(
            "plan: candidates must be a list or tuple of lsgd_jax.planner.Candidate, got "
            f"{candidates!r}; e.g. candidates=[*lsgd_jax.planner.CANDIDATES, mine]."
        )
    for c in candidates:
        if not isinstance(c, Candidate):
            raise TypeError(f"plan: {c!r} is not a lsgd_jax.planner.Candidate.")
    if not candidates:
        raise ValueError("plan: candidates is empty; pass at least one Candidate.")
    names = [c.name for c in candidates]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(
            f"plan: candidates share the names {twice}; the table and Plan.choose tell them "
            "apart by name: give each a name of its own."
        )
    return tuple(candidates)


def check_mesh(mesh: Any, node_axis: str, candidates: tuple[Candidate, ...]) -> None:
    if not isinstance(mesh, Mesh) or node_axis not in mesh.axis_names:
        axes = tuple(mesh.axis_names) if isinstance(mesh, Mesh) else None
        raise ValueError(
            f"plan: mesh must be a jax Mesh with the node axis {node_axis!r} (e.g. "
            f"lsgd_jax.make_mesh(nodes, devices_per_node)), got {mesh!r}"
            + (f"; pass node_axis= one of {axes}." if axes else ".")
        )
    if mesh.shape[node_axis] < 2:
        raise ValueError(
            f"plan: the mesh has one node along {node_axis!r}: nothing crosses nodes, so "
            "there is no link to plan for (DDP is the setup); plan on the real job's mesh."
        )
    inner = tuple(a for a in mesh.axis_names if a != node_axis)
    local = hook.DEFAULT_SUBGROUP[0]
    if inner == (local,) or not any(c in CANDIDATES for c in candidates):
        return
    if node_axis == local:
        fix = f"the node axis is the other one: node_axis={inner[0]!r}" if inner else ""
    elif len(inner) == 1:
        fix = (
            f"name the axis inside a node {local!r}: jax.sharding.Mesh(mesh.devices, "
            f"({node_axis!r}, {local!r})), as lsgd_jax.make_mesh does"
        )
    else:
        fix = f"plan on a mesh of two axes, ({node_axis!r}, {local!r}) (lsgd_jax.make_mesh)"
    raise ValueError(
        f"plan: the built-in candidates average inside a node over the mesh axis {local!r}; "
        f"this mesh's axes are {tuple(mesh.axis_names)} with node_axis={node_axis!r}: "
        f"{fix}; or pass candidates= whose chains name your axes."
    )


def check_inner_optimizer(optimizer: Any, params: Any) -> None:
    """The candidates wrap the user's optimizer: one that already averages is refused."""
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"plan: optimizer must be an optax GradientTransformation (e.g. "
            f"optax.adamw(1e-3); for optax.MultiSteps pass its .gradient_transformation()), "
            f"got {optimizer!r}."
        )
    ours = (hook.PostLocalSGDState, averaging.ModelAveragerState)
    nodes = jax.tree_util.tree_leaves(
        jax.eval_shape(optimizer.init, params), is_leaf=lambda x: isinstance(x, ours)
    )
    if any(isinstance(x, ours) for x in nodes):
        raise ValueError(
            "plan: optimizer already holds post_local_sgd or a model averager; pass the "
            "inner optimizer alone (e.g. optax.adamw(1e-3)): each candidate builds its "
            "chain around it."
        )


def check_one_replica(params: Any) -> None:
    """``params`` is one replica's: a sharded (e.g. ``replicate``-d) array is refused.

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax.planner._checks import check_one_replica
      >>> check_one_replica({"w": jnp.zeros(3)})  # the model as initialised: passes
    """
    for x in jax.tree_util.tree_leaves(params):
        if isinstance(x, jax.Array) and not x.sharding.is_fully_replicated:
            raise ValueError(
                f"plan: params must be one replica's (the model as you initialise it), got "
                f"an array of shape {x.shape} sharded as {x.sharding}; pass the params from "
                "before lsgd_jax.replicate."
            )
