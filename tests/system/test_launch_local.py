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


def test_a_failing_worker_stops_the_launch(tmp_path, monkeypatch):
    # worker 1 exits with status 3 as it starts (a sitecustomize on its PYTHONPATH);
    # worker 0 would wait for it in jax.distributed.initialize: the launch ends with
    # status 1, naming the worker, long before the timeout
    (tmp_path / "sitecustomize.py").write_text(
        "import os, sys\nif sys.argv[-2:] == ['--process-id', '1']:\n    os._exit(3)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    code, seconds, out = run_launcher(
        [*MODULE_CMD, "--processes", "2", "--devices", "1", "--timeout", "90"], 120
    )
    assert code == 1 and "launch_local: worker 1 exited with 3" in out, out[-3000:]
    assert seconds < 90


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        # before: exit 0 with nothing done; a segfault of the worker; JAX's "non-uniform
        # sharding" from the workers; "done: -1 steps"
        ("--processes 0", "argument --processes: must be a positive int, got '0'; e.g."),
        ("--devices 0", "argument --devices: must be a positive int, got '0'; e.g. --devi"),
        (
            "--processes 2 --nodes 3",
            "argument --nodes: 3 nodes cannot each hold whole processes of --processes 2; "
            "give a divisor of it (1, 2), or leave --nodes out",
        ),
        ("--processes 6 --nodes 4", "give a divisor of it (1, 2, 3, 6)"),
        ("--steps -1", "argument --steps: must be a positive int, got '-1'; e.g. --steps 60"),
        ("--steps ten", "argument --steps: must be a positive int, got 'ten'"),
        ("--start -1", "argument --start: must be an int >= 0, got '-1'; e.g. --start 10"),
        ("--period 0", "argument --period: must be a positive int, got '0'"),
        ("--ckpt-every 0", "argument --ckpt-every: must be a positive int, got '0'"),
        ("--heartbeat 0", "argument --heartbeat: must be a positive int, got '0'"),
        ("--timeout 0", "argument --timeout: must be a positive number of seconds, got '0'"),
        ("--timeout inf", "argument --timeout: must be a positive number of seconds"),
    ],
)
def test_parse_refuses_a_bad_value_naming_it_and_the_fix(capsys, argv, says):
    with pytest.raises(SystemExit) as stopped:
        launch_local.parse(argv.split())
    assert stopped.value.code == 2
    assert says in " ".join(capsys.readouterr().err.split())


def test_parse_takes_good_values():
    args = launch_local.parse("--processes 6 --nodes 3 --steps 1 --start 0".split())
    assert (args.processes, args.nodes, args.steps, args.start) == (6, 3, 1, 0)
    assert launch_local.parse(["--timeout", "2.5"]).timeout == 2.5


PINNED = (  # the launcher on 2 cores (its workers inherit them), then the module itself
    "import os, runpy; os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2]); "
    "runpy.run_module('lsgd_jax.elastic.launch_local', run_name='__main__')"
)


def test_the_workers_get_the_threads_their_devices_need(monkeypatch):
    # 2 devices a worker on 2 cores, PJRT_NPROC unset: each worker warned about its own
    # launcher's setup (a pool of 2 threads for 2 devices); now PJRT_NPROC=4
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    code, _, out = run_launcher(
        [sys.executable, "-c", PINNED, "--processes", "2", "--devices", "2", "--steps", "3"]
        + ["--timeout", "120"],
        150,
    )
    assert code == 0 and "done: 3 steps" in out, out[-3000:]
    assert "XLA's CPU client runs" not in out, out[-3000:]


def test_under_xdist_the_multi_process_files_share_one_group(request):
    # README's command (-n 2 --dist loadgroup) runs every multi-process file on one
    # worker, one test at a time: two such tests at once on 2 cores made collectives
    # time out. pytest 9.2 broke that silently (pytest-xdist issue #1386; pyproject.toml
    # pins pytest below it): the group's suffix must reach the node id.
    if request.config.getvalue("dist") == "loadgroup":
        assert request.node.nodeid.endswith("@processes"), request.node.nodeid
