"""Two processes x 4 CPU devices over gloo: training, checkpoints, desync, a killed peer.

Every launch is bounded in time, uses a free port, and reaps its processes (see
``multiprocess.py``). The worker program and its data live in ``mp_worker.py``.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
import types

import numpy as np
import pytest
from mp_worker import CFG, fresh_state, global_batch, loss_fn, make_tx, train
from multiprocess import processes, run_workers, wait_all, wait_for_text, worker_cmds

import lsgd_jax
from lsgd_jax.mesh._mesh import _check_node_rows

# several processes with collective timeouts: one such job at a time (conftest)
pytestmark = pytest.mark.xdist_group("processes")

AVERAGER = lsgd_jax.PeriodicModelAverager(CFG["period"], CFG["start"])
AVERAGING_STEPS = [s for s in range(CFG["steps"]) if AVERAGER.level(s)]  # 4, 7, 10
N_LOCAL = CFG["devices_per_process"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """An uninterrupted 2-process run, checkpointing every 2 steps."""
    out = tmp_path_factory.mktemp("baseline")
    t0 = time.perf_counter()
    run_workers("train", out, out / "ckpt", "--ckpt-every", "2")
    print(f"\n2-process training run: {time.perf_counter() - t0:.1f} s")
    return out


def load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def single_process_trajectory():
    """The same run in this process: a (2, 4) mesh of 8 devices, the global batches."""
    mesh = lsgd_jax.make_mesh(2, 4)
    step = lsgd_jax.data_parallel_step(loss_fn, make_tx(), mesh)
    traj = []
    train(
        fresh_state(mesh),
        step,
        0,
        CFG["steps"],
        global_batch,
        lambda s, st: traj.append({k: np.asarray(v) for k, v in st["params"].items()}),
    )
    return {k: np.stack([t[k] for t in traj]) for k in traj[0]}


def test_two_processes_train_like_one_process_with_eight_devices(baseline):
    info = [json.loads((baseline / f"info_p{p}.json").read_text()) for p in range(2)]
    for p, i in enumerate(info):
        assert i["process_index"] == p and i["mesh_shape"] == {"node": 2, "local": 4}
        assert i["mesh_row_is_this_process"] and i["other_rows_are_other_processes"]
    traj = [load(baseline / f"traj_p{p}.npz") for p in range(2)]
    for k in traj[0]:  # both processes gathered the same global values
        np.testing.assert_array_equal(traj[0][k], traj[1][k])
    traj = traj[0]
    averaging_gap = []
    for k, t in traj.items():  # t: [steps, 8 replicas, ...]
        for s in range(CFG["steps"]):
            rows = t[s].reshape((2, N_LOCAL) + t.shape[2:])
            for node in rows:  # the replicas of one process agree after every step, bitwise
                assert all(np.array_equal(node[0], r) for r in node[1:]), (k, s)
            gap = float(np.max(np.abs(rows[0, 0] - rows[1, 0])))
            if s < CFG["start"]:
                assert gap == 0.0, (k, s)  # global gradient mean: one model
            elif s in AVERAGING_STEPS:
                averaging_gap.append(gap)
                assert gap <= 1e-6, (k, s, gap)  # models averaged over both processes
            else:
                assert gap > 1e-4, (k, s, gap)  # local SGD: the processes' models differ
    single = single_process_trajectory()
    diff = max(float(np.max(np.abs(traj[k] - single[k]))) for k in traj)
    print(
        f"\nmax |2 processes - 1 process of 8 devices| over all steps: {diff:.2e}; "
        f"max gap between processes on averaging steps: {max(averaging_gap):.1e}"
    )
    assert diff <= 1e-5
    final = load(baseline / "final_p0.npz")
    np.testing.assert_allclose(
        np.asarray(info[0]["unreplicate"]["w1"]), final["['params']['w1']"][0], rtol=0, atol=0
    )
    np.testing.assert_allclose(
        np.asarray(info[1]["consensus"]["w2"]), final["['params']['w2']"].mean(0), atol=1e-6
    )
    assert info[0]["counters"] == {
        "[0].iter": CFG["start"],
        "[2].step": CFG["steps"],
    }


@pytest.fixture(scope="module")
def resumed(baseline, tmp_path_factory):
    """Both processes: first restore different steps (must fail), then resume twice."""
    out = tmp_path_factory.mktemp("resume")
    ckpt = out / "ckpt"
    shutil.copytree(baseline / "ckpt", ckpt)
    # Checkpoint 2 is before the switch (step 4); checkpoint 6 is inside a local period
    # (averages at 4, 7, 10). Process 0 first restores 6 and process 1 restores 4.
    run_workers("resume", out, ckpt, "--mismatch", "6", "4", "--from", "2", "6")
    return out


def test_restoring_different_steps_fails_on_every_process_instead_of_hanging(resumed):
    for p in range(2):
        info = json.loads((resumed / f"info_p{p}.json").read_text())
        err = info["mismatch_error"]
        assert err is not None, f"process {p} restored different steps without an error"
        assert "['opt_state'][2].step is 4 on replicas 4-7 (process 1); 6 on replicas 0-3" in err
        assert info["mismatch_values"] == {"['opt_state'][2].step": [4, 6]}
        print(f"\nprocess {p} detected the mismatch in {info['mismatch_seconds']:.2f} s: {err}")
        assert (
            "host counter 'data position' is 10 on host (process 0); 11 on host (process 1)"
            in (info["host_error"])
        )
        assert (
            "the processes hold different states. process 0: 0 counter values"
            in (info["structure_error"])
        )
        warned = [w for w in info["host_batch_warnings"] if "host-local" in w]
        assert len(warned) == 2  # leaves 'x' and 'y'
        assert "batch leaf ['x'] is a host-local array on a mesh of 2 processes" in warned[0]
        assert "jax.make_array_from_process_local_data" in warned[0]


@pytest.mark.parametrize("step", [2, 6])
def test_resuming_two_processes_is_bitwise_identical(baseline, resumed, step):
    want = load(baseline / "final_p0.npz")
    for p in range(2):
        got = load(resumed / f"resumed{step}_p{p}.npz")
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{k} resumed from {step}")


def test_sigkill_one_process_then_restart_both_from_the_last_checkpoint(baseline, tmp_path):
    out, ckpt = tmp_path / "killed", tmp_path / "ckpt"
    out.mkdir()
    cmds = worker_cmds(
        "train", 2, out, ckpt, "--ckpt-every", "2", "--sleep", "0.2", "--heartbeat", "5"
    )
    with processes(cmds, out) as procs:
        assert wait_for_text(procs[1], "[process 1] step 6 done", timeout=120), procs[1].output()
        procs[1].popen.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        survivor = wait_all(procs[:1], timeout=45)[0]
        detected = time.monotonic() - killed
        survivor_log = procs[0].output()
    print(f"\nprocess 1 SIGKILLed; process 0 ended with {survivor} after {detected:.1f} s")
    assert survivor is not None, "the survivor hung past 45 s (then killed by the test)"
    assert survivor != 0 and "finished" not in survivor_log
    assert "JAX distributed service detected fatal errors" in survivor_log
    assert "stopped sending heartbeats" in survivor_log
    # Saves are atomic: the newest complete checkpoint is the last one both processes made.
    assert lsgd_jax.latest_checkpoint_step(ckpt) == 6
    restart = tmp_path / "restart"
    run_workers("resume", restart, ckpt)  # both processes, a new port, the latest checkpoint
    want = load(baseline / "final_p0.npz")
    for p in range(2):
        got = load(restart / f"resumed_p{p}.npz")
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_a_node_is_inside_one_process_or_made_of_whole_processes():
    def grid(procs, cols):  # fake devices: (process_index, id)
        devs = [types.SimpleNamespace(process_index=p, id=i) for i, p in enumerate(procs)]
        return np.array(devs, dtype=object).reshape(-1, cols)

    _check_node_rows(grid([0, 0, 0, 0, 1, 1, 1, 1], 4))  # one process per node
    _check_node_rows(grid([0, 0, 0, 0, 1, 1, 1, 1], 2))  # two nodes per process
    _check_node_rows(grid([0, 1, 2, 3], 2))  # one process per device, two per node
    with pytest.raises(ValueError, match=r"only some of the devices of process\(es\) \[1\]"):
        _check_node_rows(grid([0, 0, 1, 1, 1, 1], 3))


def test_delayed_averages_across_processes_match_one_process(tmp_path, monkeypatch):
    # Several processes take a delayed mean inside the step (a background program over
    # the same devices deadlocks across processes here); one process takes it in the
    # background: the same numbers.
    monkeypatch.setenv("LSGD_TEST_DELAY", "2")
    run_workers("train", tmp_path, tmp_path / "ckpt")
    traj = [load(tmp_path / f"traj_p{p}.npz") for p in range(2)]
    for k in traj[0]:
        np.testing.assert_array_equal(traj[0][k], traj[1][k])
    single = single_process_trajectory()
    diff = max(float(np.max(np.abs(traj[0][k] - single[k]))) for k in single)
    assert diff <= 1e-5, diff
