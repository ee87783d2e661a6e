"""use_compilation_cache: a process that runs the step again loads its programs (issue 27)."""

import json
import os
import subprocess
import sys
import textwrap

import helpers
import jax
import jax.numpy as jnp
import optax
import pytest

import lsgd_jax
from lsgd_jax.step import _compile_cache

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    events = []
    jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
    import jax.numpy as jnp, optax, lsgd_jax
    folder = lsgd_jax.use_compilation_cache(sys.argv[1])
    mesh = lsgd_jax.make_mesh(2, 4)
    tx = optax.chain(lsgd_jax.post_local_sgd(2), optax.adam(0.1),
        lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, warmup_steps=2)))
    step = lsgd_jax.data_parallel_step(lambda p, b: jnp.mean((b @ p) ** 2), tx, mesh)
    p, s = lsgd_jax.replicate(jnp.ones(3), mesh), lsgd_jax.replicate(tx.init(jnp.ones(3)), mesh)
    for _ in range(5):  # every phase: warm-up, average, local
        p, s, loss = step(p, s, jnp.arange(24.0).reshape(8, 3) / 24)
    hits = sum(e.endswith("cache_hits") for e in events)
    misses = sum(e.endswith("cache_misses") for e in events)
    print(json.dumps({"folder": folder, "hits": hits, "misses": misses, "loss": float(loss)}))
    """
)


def run(folder):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}  # not the tests'
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(folder)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_run_loads_every_program_and_compiles_nothing(tmp_path):
    first, second = run(tmp_path / "cache"), run(tmp_path / "cache")
    assert first["folder"] == str(tmp_path / "cache")
    assert first["misses"] >= 3 and first["hits"] == 0  # the three phases, compiled
    assert second["misses"] == 0 and second["hits"] >= 3  # loaded, none compiled
    assert second["loss"] == first["loss"] > 0
    assert any((tmp_path / "cache").iterdir())


def test_a_folder_jax_already_uses_is_kept():
    # conftest sets one for the test session: the call leaves it as it is
    current = jax.config.jax_compilation_cache_dir
    assert current
    assert lsgd_jax.use_compilation_cache("/somewhere/else") == current
    assert jax.config.jax_compilation_cache_dir == current


def test_the_default_folder_follows_the_environment(monkeypatch):
    monkeypatch.setenv(_compile_cache.ENV, "/scratch/cache")
    assert _compile_cache.default_directory() == "/scratch/cache"
    monkeypatch.delenv(_compile_cache.ENV)
    assert _compile_cache.default_directory().endswith(".cache/lsgd_jax/jax-compilation-cache")


def backend_compiles(fn):
    """How many programs XLA compiles while ``fn`` runs."""
    seen = []

    def listener(name, duration, **kwargs):
        if name.endswith("backend_compile_duration"):
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return len(seen)


def test_the_ledger_and_the_training_compile_each_program_once():
    mesh = helpers.mesh_2x4()
    tx = optax.chain(
        lsgd_jax.post_local_sgd(2),
        optax.adamw(1e-3),
        lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, warmup_steps=2)),
    )
    params = {"w": jnp.linspace(0.0, 1.0, 12).reshape(3, 4), "b": jnp.ones(4)}
    loss = lambda p, b: jnp.mean((b @ p["w"] + p["b"]) ** 2)  # noqa: E731
    # on the mesh already (a host array would add JAX's own transfer program)
    batch = helpers.put(jnp.arange(24.0).reshape(8, 3) / 24, mesh, helpers.DATA)

    def fresh():
        return lsgd_jax.replicate(params, mesh), lsgd_jax.replicate(tx.init(params), mesh)

    def train(step, n=5):
        p, s = fresh()
        for _ in range(n):
            p, s, out = step(p, s, batch)
        out.block_until_ready()

    # the ledger first: it compiles the three phases' programs, training none
    step = lsgd_jax.data_parallel_step(loss, tx, mesh, compile_ahead=0)
    assert (
        backend_compiles(lambda: lsgd_jax.communication_ledger(step, *fresh(), batch, num_steps=5))
        >= 3
    )
    assert backend_compiles(lambda: train(step)) == 0
    # training first: the ledger reads what it compiled
    step = lsgd_jax.data_parallel_step(loss, tx, mesh, compile_ahead=0)
    train(step)
    assert (
        backend_compiles(lambda: lsgd_jax.communication_ledger(step, *fresh(), batch, num_steps=5))
        == 0
    )
