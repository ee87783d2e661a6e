"""Shared test helpers: meshes, shard_map wrappers, and a plain-Python schedule model."""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lsgd_jax

DATA = P(("node", "local"))
ROOT = pathlib.Path(__file__).resolve().parents[1]  # the checkout


def load_example(name, folder="examples"):
    """``<folder>/<name>.py`` (``examples`` by default) imported as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def smap(fn, mesh, in_specs, out_specs, check_vma=True):
    """jit(shard_map(fn)) over ``mesh``."""
    return jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
    )


def put(tree, mesh, spec):
    return jax.device_put(tree, NamedSharding(mesh, spec))


def drain_callback_errors():
    """Drops what a program whose host callback raised on every device leaves behind:
    JAX keeps the failed program's runtime tokens and raises at every later effects
    barrier of this process, i.e. in whatever the next test runs on this worker (JAX has
    no public call for it)."""
    from jax._src import dispatch

    try:
        jax.effects_barrier()
    except Exception:  # noqa: BLE001  (the same error, from the other devices)
        pass
    dispatch.runtime_tokens.clear()


def squeeze(tree):
    return jax.tree.map(lambda x: x[0], tree)


def unsqueeze(tree):
    return jax.tree.map(lambda x: x[None], tree)


def rank_values(n, shape=(5,), dtype=jnp.float32):
    """Replica r holds ``r * ones(shape)``: PyTorch's test tensors."""
    return jnp.arange(n, dtype=dtype).reshape((n,) + (1,) * len(shape)) * jnp.ones(shape, dtype)


def torch_periodic_level(step, period, warmup):
    """PyTorch's PeriodicModelAverager rule, in plain Python."""
    return int(step >= warmup and (step - warmup) % period == 0)


def torch_hierarchical_level(step, periods, warmup):
    """PyTorch's HierarchicalModelAverager rule, in plain Python (1-based level or 0)."""
    if step < warmup:
        return 0
    for k in reversed(range(len(periods))):
        if step % periods[k] == 0:
            return k + 1
    return 0


def group_means(values: np.ndarray, group_size: int) -> np.ndarray:
    """Mean over consecutive blocks of ``group_size`` replicas (PyTorch's subgroups)."""
    v = np.asarray(values, np.float64)
    blocks = v.reshape((-1, group_size) + v.shape[1:]).mean(axis=1, keepdims=True)
    return np.broadcast_to(blocks, (v.shape[0] // group_size, group_size) + v.shape[1:]).reshape(
        v.shape
    )


def mesh_2x4():
    return lsgd_jax.make_mesh(num_nodes=2, devices_per_node=4)


def types_of(tree):
    """(treedef, leaf types): shapes, dtypes, weak types and varying axes."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, [jax.typeof(x) for x in leaves]


def linear_loss(params, x):
    return jnp.mean((x @ params["w"] + params["b"]) ** 2)


def train_step(tx, mesh, spec=DATA, loss=linear_loss, check_types=False):
    """A jitted per-replica step ``(params, opt_state, x) -> (params, opt_state)`` over
    replicated params and optimizer state; optionally asserts the state keeps its types."""

    def body(params, opt_state, x):
        params, opt_state = squeeze(params), squeeze(opt_state)
        grads = jax.grad(loss)(params, x[0])
        before = types_of(opt_state)
        updates, opt_state = tx.update(grads, opt_state, params)
        if check_types:
            assert types_of(opt_state) == before, "optimizer state changed type"
        return unsqueeze(optax.apply_updates(params, updates)), unsqueeze(opt_state)

    return smap(body, mesh, (spec, spec, spec), (spec, spec))


def mlp_loss(params, batch):
    """A tanh MLP with one hidden layer (and its bias ``b1`` if the params hold one): the
    mean squared error of ``tanh(x @ w1 [+ b1]) @ w2`` against ``y``."""
    h = batch["x"] @ params["w1"]
    h = jnp.tanh(h + params["b1"]) if "b1" in params else jnp.tanh(h)
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def mlp_params(din=6, width=8, dout=1, *, bias=False, scale=None):
    """mlp_loss's params, the same each call: normal weights from ``jax.random.key(0)``
    divided by 3 (``scale=None``) or multiplied by ``scale``; a zero ``b1`` if ``bias``."""
    k1, k2 = jax.random.split(jax.random.key(0))
    w1, w2 = jax.random.normal(k1, (din, width)), jax.random.normal(k2, (width, dout))
    w1, w2 = (w1 / 3, w2 / 3) if scale is None else (w1 * scale, w2 * scale)
    if not bias:
        return {"w1": w1, "w2": w2}
    return {"w1": w1, "b1": jnp.zeros(width), "w2": w2}


def tiny_mlp(din=6, width=8, dout=1, *, bias=False, scale=None):
    """``(init_params, loss_fn)`` of a tiny MLP: ``init_params()`` is mlp_params with these
    arguments (a keyword given to it overrides one), ``loss_fn`` is mlp_loss.

    Example: ``init_params, loss_fn = tiny_mlp()`` (6 -> 8 -> 1, no bias)."""
    init = functools.partial(mlp_params, din=din, width=width, dout=dout, bias=bias, scale=scale)
    return init, mlp_loss


def state_for(tx, mesh, scale=1.0):
    """``{"params", "opt_state"}`` of mp_worker.py's model (its params times ``scale``) under
    ``tx``, replicated over ``mesh``: the state the checkpoint tests save and restore."""
    from mp_worker import init_params

    p0 = jax.tree.map(lambda x: x * scale, init_params())
    return {
        "params": lsgd_jax.replicate(p0, mesh),
        "opt_state": lsgd_jax.replicate(tx.init(p0), mesh),
    }


def isinstance_sites(classes, allowed_folders):
    """``folder/module.py:line`` of every ``isinstance(x, <one of classes>)`` in the
    package outside ``allowed_folders`` (class names, bare or as attributes)."""
    import ast

    package = ROOT / "lsgd_jax"
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.parts[0] in allowed_folders:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                names = {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                names |= {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                if names & set(classes):
                    found.append(f"{rel}:{node.lineno}")
    return found
