"""lsgd_jax.elastic.launch_local (and examples/launch_local.py, which runs it): N local
processes train, checkpoint, and resume."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
from multiprocess import ROOT, run_launcher

from lsgd_jax.elastic import launch_local

# several processes with collective timeouts: one such job at a time (conftest)
pytestmark = pytest.mark.xdist_group("processes")

SCRIPT = ROOT / "examples" / "launch_local.py"
SCRIPT_CMD = [sys.executable, str(SCRIPT)]
MODULE_CMD = [sys.executable, "-m", "lsgd_jax.elastic.launch_local"]


def run_example(*args: str, cmd: list[str] = SCRIPT_CMD, timeout: float = 150) -> str:
    defaults = [] if "--processes" in args else ["--processes", "2", "--devices", "2"]
    cmd = [*cmd, *defaults, *args]
    cmd += ["--timeout", str(timeout - 30)]  # the launcher stops its workers first
    code, _, out = run_launcher(cmd, timeout)
    assert code == 0, out[-3000:]
    return out


def test_launch_local_trains_checkpoints_and_resumes_on_another_layout(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # the old command: the example script
    out = run_example("--steps", "20", "--ckpt-dir", ckpt, "--ckpt-every", "10")
    assert "mesh {'node': 2, 'local': 2}: 1 process(es) per node" in out
    assert "done: 20 steps" in out
    # The same (2, 2) mesh from four processes of one device, two per node (like one
    # process per GPU): each process restores only its own replica's shards. Started
    # as the package's module this time: it resumes what the script saved.
    out = run_example(
        "--processes", "4", "--devices", "1", "--nodes", "2", "--steps", "30",
        "--ckpt-dir", ckpt, "--ckpt-every", "10", cmd=MODULE_CMD,
    )  # fmt: skip
    assert "mesh {'node': 2, 'local': 2}: 2 process(es) per node" in out
    assert "resumed from the checkpoint of step 20" in out and "done: 10 steps" in out
    assert sorted(os.listdir(ckpt)) == ["10", "20", "30"]


def test_the_script_is_the_module():
    # Before: the launcher lived in examples/ only, and could not be imported.
    spec = importlib.util.spec_from_file_location("launch_local_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main is launch_local.main
    assert launch_local.worker_command(["--steps", "5"], 9, 1) == [
        *MODULE_CMD, "--steps", "5", "--port", "9", "--process-id", "1",
    ]  # fmt: skip
    args = launch_local.parse(["--processes", "3", "--ckpt-dir", "c"])
    assert (args.processes, args.devices, args.ckpt_dir, args.process_id) == (3, 4, "c", None)


def test_a_failing_worker_stops_the_launch():
    # a worker that cannot start (a mesh of 3 nodes from 2 processes) ends the launch
    # with status 1, naming the worker, long before the timeout
    code, seconds, out = run_launcher(
        [*MODULE_CMD, "--processes", "2", "--devices", "1", "--nodes", "3", "--timeout", "90"],
        120,
    )
    assert code == 1 and "launch_local: worker" in out and "exited with" in out, out[-3000:]
    assert seconds < 90


def test_under_xdist_the_multi_process_files_share_one_group(request):
    # README's command (-n 2 --dist loadgroup) runs every multi-process file on one
    # worker, one test at a time: two such tests at once on 2 cores made collectives
    # time out. pytest 9.2 broke that silently (pytest-xdist issue #1386; pyproject.toml
    # pins pytest below it): the group's suffix must reach the node id.
    if request.config.getvalue("dist") == "loadgroup":
        assert request.node.nodeid.endswith("@processes"), request.node.nodeid
