"""Eight simulated CPU devices, set before JAX starts its backend; and the test tiers.

Two tiers: the fast one (``python -m pytest -q -n 2 -m "not slow"``, under 3 minutes on
2 cores) for everyday work, and the slow one: tests that start several processes, run
the examples, the notebook or the benchmarks, and the long single-process suites (the
specification test, the defect probes, resizing, FSDP, delays, quantized means). README's
test command (and CI) runs both. Each run keeps every file's seconds in pytest's cache
(``.pytest_cache/v/lsgd/file_seconds``): move a file between the tiers by them.
"""

import os
import pathlib
import shutil
import tempfile

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

# One persistent compilation cache for the whole test session, shared by the xdist
# workers (they inherit the controller's environment) and by every process the tests
# start (JAX reads the JAX_* variables when it starts): the tests compile the same
# programs over and over (parametrized cases, the spec test's draws, each elastic
# launch's three trainers). Measured: test_delay, test_checkpoint_resize, test_fsdp and
# test_comm_defects on 2 workers took 112 s with a cold cache against 166 s without.
# A fresh folder per session (removed at its end), so no run reads another's programs.
_CACHE = os.environ.setdefault(
    "LSGD_JAX_TEST_CACHE", tempfile.mkdtemp(prefix="lsgd_jax-test-jit-cache-")
)
for _name, _value in [
    ("jax_compilation_cache_dir", _CACHE),
    ("jax_persistent_cache_min_compile_time_secs", 0),
    ("jax_persistent_cache_min_entry_size_bytes", 0),
]:
    jax.config.update(_name, _value)
    os.environ[_name.upper()] = str(_value)


def pytest_sessionfinish(session):
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without -n)
        shutil.rmtree(_CACHE, ignore_errors=True)


# Whole files of the slow tier: multi-process, elastic, examples, notebook, benchmarks.
SLOW_FILES = {
    "test_multiprocess.py",
    "test_elastic.py",
    "test_elastic_checkpoint.py",
    "test_elastic_model_state.py",
    "test_elastic_fsdp.py",
    "test_launch_local.py",
    "test_notebook.py",
    "test_examples.py",
    "test_accuracy_benchmark.py",
    "test_demo.py",
    "test_lm_example.py",
    # single-process, but long (seconds summed over 2 workers, 2026-12-01): the fast
    # tier keeps one cheap file per concern
    "test_spec.py",  # 233
    "test_checkpoint_resize.py",  # 50
    "test_fsdp.py",  # 49
    "test_comm_defects.py",  # 44
    "test_quantize.py",  # 42
    "test_delay.py",  # 38
    "test_hook_quantized.py",  # 36
    "test_phases.py",  # 31
    "test_layouts.py",  # 27
    "test_robustness.py",  # 24
}


# Files whose tests start several processes with collective timeouts: with pytest-xdist
# (README's command: -n 2 --dist loadgroup) they run in one group, one job at a time on
# one worker, while the other worker runs the rest: two such jobs at once on 2 cores
# made collectives time out (seen with two groups on three workers).
PROCESS_GROUPS = dict.fromkeys(
    [
        "test_elastic.py",
        "test_multiprocess.py",
        "test_elastic_checkpoint.py",
        "test_elastic_model_state.py",
        "test_elastic_fsdp.py",
        "test_launch_local.py",
    ],
    "processes",
)


# tryfirst: pytest-xdist reads the xdist_group markers in its own hook of this name on
# each worker; without it, that hook ran before this one and saw no group, so the
# multi-process files were spread over both workers after all.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        name = pathlib.Path(str(item.fspath)).name
        if name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
        if name in PROCESS_GROUPS:
            item.add_marker(pytest.mark.xdist_group(PROCESS_GROUPS[name]))


_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    name = pathlib.Path(report.fspath).name
    _SECONDS[name] = _SECONDS.get(name, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """How long each tier, and the slowest files, took in this run (setup, call and
    teardown of their tests; summed over the workers under -n)."""
    if not _SECONDS:
        return
    slow = sum(t for name, t in _SECONDS.items() if name in SLOW_FILES)
    fast = sum(_SECONDS.values()) - slow
    terminalreporter.write_line(
        f"test tiers: fast {fast / 60:.1f} min, slow {slow / 60:.1f} min "
        "(the fast tier alone: python -m pytest -q -n 2 -m 'not slow')"
    )
    top = sorted(_SECONDS.items(), key=lambda kv: -kv[1])
    terminalreporter.write_line(
        "slowest files: " + ", ".join(f"{name[5:-3]} {t:.0f} s" for name, t in top[:12])
    )
    # Every file's seconds, for choosing the tiers: .pytest_cache/lsgd_file_seconds.json
    cache = terminalreporter.config.cache
    if cache is not None:
        cache.set("lsgd/file_seconds", {name: round(t, 1) for name, t in top})
