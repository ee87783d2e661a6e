"""Eight simulated CPU devices, set before JAX starts its backend; and the test tiers.

Two tiers: the fast one (``python -m pytest -q -m "not slow"``) for everyday work, and
the slow one: tests that start several processes, run the examples, the notebook or
the benchmarks. README's test command (and CI) runs both.
"""

import pathlib

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

# Whole files of the slow tier: multi-process, elastic, examples, notebook, benchmarks.
SLOW_FILES = {
    "test_chaos.py",
    "test_multiprocess.py",
    "test_elastic.py",
    "test_elastic_checkpoint.py",
    "test_elastic_model_state.py",
    "test_launch_local.py",
    "test_notebook.py",
    "test_examples.py",
    "test_accuracy_benchmark.py",
    "test_demo.py",
    "test_lm_example.py",
}


# Files whose tests start several processes with collective timeouts: with pytest-xdist
# (README's command: -n 3 --dist loadgroup) they run one at a time on one worker, so
# that two such jobs never compete with each other for the cores.
PROCESS_FILES = {
    "test_chaos.py",
    "test_multiprocess.py",
    "test_elastic.py",
    "test_elastic_checkpoint.py",
    "test_elastic_model_state.py",
    "test_launch_local.py",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = pathlib.Path(str(item.fspath)).name
        if name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
        if name in PROCESS_FILES:
            item.add_marker(pytest.mark.xdist_group("processes"))


_SECONDS = {"fast": 0.0, "slow": 0.0}


def pytest_runtest_logreport(report):
    tier = "slow" if pathlib.Path(report.fspath).name in SLOW_FILES else "fast"
    _SECONDS[tier] += report.duration


def pytest_terminal_summary(terminalreporter):
    """How long each tier took in this run (setup, call and teardown of its tests)."""
    fast, slow = _SECONDS["fast"], _SECONDS["slow"]
    terminalreporter.write_line(
        f"test tiers: fast {fast / 60:.1f} min, slow {slow / 60:.1f} min "
        "(the fast tier alone: python -m pytest -q -m 'not slow')"
    )
