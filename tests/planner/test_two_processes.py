"""lsgd_jax.plan in a job of two processes: each measures the link, the compute and each
kind of step with its own clock, yet both must fit the same link, time the same steps
and choose the same setup (else they would build different steps, whose collectives
never meet)."""

import json
import sys
import textwrap

import pytest
from multiprocess import free_port, processes, wait_all

WORKER = textwrap.dedent(
    """
    import json, sys
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    port, me, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=me,
                               initialization_timeout=60)
    import jax.numpy as jnp, numpy as np, optax, lsgd_jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = lsgd_jax.make_mesh()  # a node per process
    rows = NamedSharding(mesh, P(lsgd_jax.data_axes(mesh)))
    local = np.random.default_rng(me).standard_normal((4, 512), np.float32)
    batch = jax.make_array_from_process_local_data(rows, local)
    found = lsgd_jax.plan(lambda p, b: jnp.mean((b @ p) ** 2), jnp.zeros(512), batch, mesh,
                          optax.sgd(0.1), num_steps=60, tolerance=0.05)
    json.dump({"link": [found.link.bytes_per_s, found.link.latency_s],
               "flat": [found.flat_link.bytes_per_s, found.flat_link.latency_s],
               "compute_s": found.compute_s, "chosen": found.chosen.name,
               "order": [r.name for r in found.rows],
               "phases": {r.name: [r.phase_compute_s, r.timed_phases] for r in found.rows}},
              open(f"{out}/plan{me}.json", "w"))
    """
)


@pytest.mark.slow
def test_both_processes_fit_the_same_link_and_choose_the_same_setup(tmp_path):
    script = tmp_path / "plan_worker.py"
    script.write_text(WORKER)
    port = str(free_port())
    cmds = [[sys.executable, str(script), port, str(i), str(tmp_path)] for i in range(2)]
    with processes(cmds, tmp_path) as procs:
        codes = wait_all(procs, timeout=240)
        logs = [p.output()[-3000:] for p in procs]
    assert codes == [0, 0], logs
    plans = [json.loads((tmp_path / f"plan{i}.json").read_text()) for i in range(2)]
    assert plans[0] == plans[1]
    assert plans[0]["link"][0] > 0 and plans[0]["compute_s"] >= 0
    # each kind of step timed on the mesh, the same agreed seconds in both processes
    for computes, timed in plans[0]["phases"].values():
        assert sorted(timed) == sorted(computes) and min(computes.values()) >= 0
