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

# XLA's CPU pool needs 2 threads a device, or a program with collectives can starve
# (lsgd_jax.simulate_cpu_devices does the same; docs/training_loops.md says why).
os.environ.setdefault("PJRT_NPROC", "16")
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


TESTS = pathlib.Path(__file__).resolve().parent
SYSTEM = TESTS / "system"  # several processes, the examples, the notebook: the slow tier


# tryfirst: pytest-xdist reads the xdist_group markers in its own hook of this name on
# each worker; without it, that hook ran before this one and saw no group.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The slow tier by where a test lives: ``tests/system/`` (several processes, the
    examples, the notebook, the benchmarks run end to end), and the long single-process
    files, which say so themselves (``pytestmark = pytest.mark.slow``)."""
    for item in items:
        if SYSTEM in pathlib.Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.slow)


def _name(fspath) -> str:
    """A test file's path under tests/, without ``test_`` and ``.py``: ``step/phases``."""
    rel = pathlib.Path(str(fspath)).resolve().relative_to(TESTS)
    return str(rel.with_name(rel.name.removeprefix("test_")).with_suffix(""))


_SECONDS: dict[str, float] = {}


_SLOW: set[str] = set()


def pytest_runtest_logreport(report):
    name = _name(report.fspath)
    _SECONDS[name] = _SECONDS.get(name, 0.0) + report.duration
    if "slow" in report.keywords:
        _SLOW.add(name)


def pytest_terminal_summary(terminalreporter):
    """How long each tier, and the slowest files, took in this run (setup, call and
    teardown of their tests; summed over the workers under -n)."""
    if not _SECONDS:
        return
    slow = sum(t for name, t in _SECONDS.items() if name in _SLOW)
    fast = sum(_SECONDS.values()) - slow
    terminalreporter.write_line(
        f"test tiers: fast {fast / 60:.1f} min, slow {slow / 60:.1f} min "
        "(the fast tier alone: python -m pytest -q -n 2 -m 'not slow')"
    )
    top = sorted(_SECONDS.items(), key=lambda kv: -kv[1])
    terminalreporter.write_line(
        "slowest files: " + ", ".join(f"{name} {t:.0f} s" for name, t in top[:12])
    )
    # Every file's seconds, for choosing the tiers: .pytest_cache/lsgd_file_seconds.json
    cache = terminalreporter.config.cache
    if cache is not None:
        cache.set("lsgd/file_seconds", {name: round(t, 1) for name, t in top})
