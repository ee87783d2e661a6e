"""use_compilation_cache: a process that runs the step again loads its programs (issue 27)."""

import json
import math
import os
import pathlib
import subprocess
import sys
import textwrap
import warnings

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


@pytest.fixture
def no_cache_yet(monkeypatch):
    """JAX's cache unset (conftest sets one for the session), as in a fresh process;
    restored afterwards. No warning has been given yet."""
    config = jax.config
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    saved = {name: getattr(config, name) for name in names}
    monkeypatch.setattr(_compile_cache, "_WARNED", set())
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        yield
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)


def a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("not a folder")
    return path


def unusable_folders(tmp_path):
    """Folders no one can write, root included (chmod does not stop root): below a
    regular file, a file in the folder's place, below /proc, and /proc itself."""
    file = a_file(tmp_path)
    return [
        (file / "cache", f"{file} is a file, not a folder"),
        (file, f"{file} is a file, not a folder"),
        (pathlib.Path("/proc/lsgd_jax_no_such/cache"), "cannot create or write to it"),
        (pathlib.Path("/proc"), "cannot create or write to it"),
    ]


def test_an_unusable_folder_warns_once_and_leaves_the_cache_off(tmp_path, no_cache_yet):
    # Before: PermissionError, NotADirectoryError or FileExistsError from mkdir, and
    # every caller (the demo, the examples, elastic.initialize) ended there.
    for folder, why in unusable_folders(tmp_path):
        with pytest.warns(RuntimeWarning) as caught:
            assert lsgd_jax.use_compilation_cache(folder) is None
        (message,) = [str(w.message) for w in caught]
        assert f"cannot keep compiled programs in {folder} ({why}" in message
        assert "compiling without the cache" in message
        assert "use_compilation_cache(directory=...)" in message and _compile_cache.ENV in message
        assert jax.config.jax_compilation_cache_dir is None  # JAX compiles as without it
        with warnings.catch_warnings():  # once per folder
            warnings.simplefilter("error")
            assert lsgd_jax.use_compilation_cache(folder) is None
    assert jax.jit(lambda x: x * 2)(21) == 42  # and it compiles


def test_an_unwritable_default_folder_warns_too(tmp_path, monkeypatch, no_cache_yet):
    monkeypatch.setenv("HOME", str(a_file(tmp_path) / "home"))
    monkeypatch.delenv(_compile_cache.ENV, raising=False)
    with pytest.warns(RuntimeWarning, match=_compile_cache.ENV):
        assert lsgd_jax.use_compilation_cache() is None
    monkeypatch.setenv(_compile_cache.ENV, str(tmp_path / "from_env"))  # the remedy named
    assert lsgd_jax.use_compilation_cache() == str(tmp_path / "from_env")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "from_env")


@pytest.mark.parametrize("setting", ["jax_compilation_cache_dir", "JAX_COMPILATION_CACHE_DIR"])
def test_a_configured_folder_that_cannot_be_used_warns_once(
    tmp_path, monkeypatch, no_cache_yet, setting
):
    # issue 33: JAX_COMPILATION_CACHE_DIR (or jax.config's folder) naming a file was
    # returned as the folder in use, with no warning (JAX then warned as it compiled)
    file = a_file(tmp_path)
    jax.config.update("jax_compilation_cache_dir", str(file))
    if setting.isupper():  # JAX read it from the environment
        monkeypatch.setenv(setting, str(file))
    with pytest.warns(RuntimeWarning) as caught:
        assert lsgd_jax.use_compilation_cache() is None
    (message,) = [str(w.message) for w in caught]
    assert message.startswith(
        f"use_compilation_cache: JAX's compilation cache folder {file} (set by {setting}) "
        f"cannot be used ({file} is a file, not a folder)"
    )
    assert f"Set {setting} to a writable folder, or leave it unset" in message
    assert jax.config.jax_compilation_cache_dir == str(file)  # the user's setting, as it was
    with warnings.catch_warnings():  # once
        warnings.simplefilter("error")
        assert lsgd_jax.use_compilation_cache(tmp_path / "other") is None
    assert not (tmp_path / "other").exists()


def test_a_configured_folder_that_works_or_is_a_url_is_kept(tmp_path, no_cache_yet):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))
    assert lsgd_jax.use_compilation_cache(tmp_path / "mine") == str(tmp_path / "theirs")
    assert (tmp_path / "theirs").is_dir() and not (tmp_path / "mine").exists()
    jax.config.update("jax_compilation_cache_dir", "gs://bucket/jax-cache")  # JAX's to reach
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lsgd_jax.use_compilation_cache() == "gs://bucket/jax-cache"
    assert not pathlib.Path("gs:").exists()


def test_a_usable_folder_is_made_and_set(tmp_path, no_cache_yet):
    folder = tmp_path / "new" / "cache"
    assert lsgd_jax.use_compilation_cache(folder, min_compile_time_s=0.5) == str(folder)
    assert folder.is_dir() and not any(folder.iterdir())  # the write check left nothing
    assert jax.config.jax_compilation_cache_dir == str(folder)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.5


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"min_compile_time_s": "1"}, TypeError, "min_compile_time_s must be a real number, got '"),
        ({"min_compile_time_s": math.nan}, ValueError, "min_compile_time_s must be a finite"),
        ({"min_compile_time_s": math.inf}, ValueError, "min_compile_time_s must be a finite"),
        ({"min_compile_time_s": -1}, ValueError, "min_compile_time_s must be >= 0 seconds"),
        ({"min_compile_time_s": True}, TypeError, "min_compile_time_s must be a real number"),
        ({"directory": 3}, TypeError, "directory must be a folder's path"),
        ({"directory": ""}, ValueError, "directory is an empty path"),
        # issue 33: a bare "embedded null byte" from mkdir; a blank name was accepted
        ({"directory": "/a\x00b"}, ValueError, "directory holds a null character, .*'/a"),
        ({"directory": "   "}, ValueError, r"directory is blank \('   ': white space only\)"),
        ({"directory": pathlib.Path(" \t")}, ValueError, "directory is blank"),
    ],
)
def test_bad_arguments_are_refused_before_the_folder_is_made(tmp_path, kwargs, error, message):
    # Before: "1" failed with "'<' not supported" after the folder was made, NaN was
    # accepted, and none of them was checked where JAX's cache was already set.
    folder = tmp_path / "not_made"
    kwargs = {"directory": folder, **kwargs}
    with pytest.raises(error, match=f"^use_compilation_cache: {message}"):
        lsgd_jax.use_compilation_cache(**kwargs)  # the conftest's cache is set
    assert not folder.exists()


@pytest.mark.slow
def test_the_demo_runs_with_an_unwritable_home(tmp_path):
    # Before: the demo exited with status 1 (NotADirectoryError) before its first step.
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.pop(_compile_cache.ENV, None)
    env["HOME"] = str(a_file(tmp_path) / "home")
    out = subprocess.run(
        [sys.executable, "-m", "lsgd_jax.demo", "--steps", "3", "--start", "1", "--periods", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    folder = pathlib.Path(env["HOME"]) / ".cache/lsgd_jax/jax-compilation-cache"
    assert out.stderr.count(f"cannot keep compiled programs in {folder}") == 1, out.stderr
    assert "post-local SGD, H=2" in out.stdout


def backend_compiles(fn):
    """How many programs XLA compiles on this thread while ``fn`` runs (the listener is
    process-wide: an earlier test's step may still compile on its background thread)."""
    import threading

    seen = []
    me = threading.current_thread().name

    def listener(name, duration, **kwargs):
        if name.endswith("backend_compile_duration") and threading.current_thread().name == me:
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
