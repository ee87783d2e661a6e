"""examples/launch_local.py: N local processes train, checkpoint, and resume."""

from __future__ import annotations

import os
import sys

import pytest
from multiprocess import ROOT, run_launcher

# several processes with collective timeouts: one such job at a time (conftest)
pytestmark = pytest.mark.xdist_group("processes")

SCRIPT = ROOT / "examples" / "launch_local.py"


def run_example(*args: str, timeout: float = 150) -> str:
    defaults = [] if "--processes" in args else ["--processes", "2", "--devices", "2"]
    cmd = [sys.executable, str(SCRIPT), *defaults, *args]
    cmd += ["--timeout", str(timeout - 30)]  # the launcher stops its workers first
    code, _, out = run_launcher(cmd, timeout)
    assert code == 0, out[-3000:]
    return out


def test_launch_local_trains_checkpoints_and_resumes_on_another_layout(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    out = run_example("--steps", "20", "--ckpt-dir", ckpt, "--ckpt-every", "10")
    assert "mesh {'node': 2, 'local': 2}: 1 process(es) per node" in out
    assert "done: 20 steps" in out
    # The same (2, 2) mesh from four processes of one device, two per node (like one
    # process per GPU): each process restores only its own replica's shards.
    out = run_example(
        "--processes", "4", "--devices", "1", "--nodes", "2", "--steps", "30",
        "--ckpt-dir", ckpt, "--ckpt-every", "10",
    )  # fmt: skip
    assert "mesh {'node': 2, 'local': 2}: 2 process(es) per node" in out
    assert "resumed from the checkpoint of step 20" in out and "done: 10 steps" in out
    assert sorted(os.listdir(ckpt)) == ["10", "20", "30"]


def test_under_xdist_the_multi_process_files_share_one_group(request):
    # README's command (-n 2 --dist loadgroup) runs every multi-process file on one
    # worker, one test at a time: two such tests at once on 2 cores made collectives
    # time out. pytest 9.2 broke that silently (pytest-xdist issue #1386; pyproject.toml
    # pins pytest below it): the group's suffix must reach the node id.
    if request.config.getvalue("dist") == "loadgroup":
        assert request.node.nodeid.endswith("@processes"), request.node.nodeid
