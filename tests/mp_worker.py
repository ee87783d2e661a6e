"""One process of a multi-process post-local SGD run, and the training program it runs.

Imported by the tests (the same model, data and optimizer in one process with 8
devices), and run as a worker by ``multiprocess.launch``::

    python tests/mp_worker.py --port P --processes 2 --process-id I --out DIR MODE ...

Each process has 4 CPU devices and joins the others over gloo; ``make_mesh()`` puts each
process's devices on its own row ("node"), and each process feeds its own rows of
every global batch. Modes:

* ``train``: a fresh run of ``CFG["steps"]`` steps; writes every step's params (all
  replicas, gathered), checkpoints every ``--ckpt-every`` steps, and the final state.
* ``resume``: restores a checkpoint (``--from K``, or the latest) and trains to the end;
  writes the final state. With ``--mismatch A B`` it first restores step A on process
  0 and B on the others, and records the error that must follow.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import numpy as np

CFG = {
    "steps": 12,
    "start": 4,  # start_localSGD_iter == warmup_steps: averages at steps 4, 7, 10
    "period": 3,
    "lr": 0.05,
    "momentum": 0.9,
    "din": 6,
    "hidden": 8,
    "dout": 2,
    "rows_per_device": 4,
    "processes": 2,
    "devices_per_process": 4,
    "seed": 7,
}


def make_tx():
    """The run's optimizer; ``LSGD_TEST_DELAY=tau`` in the environment delays its averages."""
    import optax

    import lsgd_jax

    delay = int(os.environ.get("LSGD_TEST_DELAY", "0"))
    return optax.chain(
        lsgd_jax.post_local_sgd(CFG["start"]),
        optax.sgd(CFG["lr"], momentum=CFG["momentum"]),
        lsgd_jax.model_averaging(
            lsgd_jax.PeriodicModelAverager(CFG["period"], CFG["start"], delay=delay)
        ),
    )


def init_params():
    rng = np.random.default_rng(CFG["seed"])
    d, h, o = CFG["din"], CFG["hidden"], CFG["dout"]
    return {
        "w1": (rng.standard_normal((d, h)) / np.sqrt(d)).astype(np.float32),
        "b1": np.zeros(h, np.float32),
        "w2": (rng.standard_normal((h, o)) / np.sqrt(h)).astype(np.float32),
    }


def loss_fn(params, batch):
    import jax.numpy as jnp

    pred = jnp.tanh(batch["x"] @ params["w1"] + params["b1"]) @ params["w2"]
    return jnp.mean((pred - batch["y"]) ** 2)


def local_batch(step: int, process: int) -> dict[str, np.ndarray]:
    """The rows process ``process`` feeds at ``step`` (different data on every process)."""
    rng = np.random.default_rng([CFG["seed"], step, process])
    n = CFG["rows_per_device"] * CFG["devices_per_process"]
    x = rng.standard_normal((n, CFG["din"])).astype(np.float32)
    y = np.stack([np.sin(x.sum(1)), np.cos(x[:, 0])], 1).astype(np.float32)
    return {"x": x, "y": y + 0.1 * process}


def global_batch(step: int) -> dict[str, np.ndarray]:
    """The whole batch of ``step``: process 0's rows, then process 1's, ..."""
    parts = [local_batch(step, p) for p in range(CFG["processes"])]
    return {k: np.concatenate([b[k] for b in parts]) for k in parts[0]}


def fresh_state(mesh):
    import lsgd_jax

    p0 = init_params()
    return {
        "params": lsgd_jax.replicate(p0, mesh),
        "opt_state": lsgd_jax.replicate(make_tx().init(p0), mesh),
    }


def train(state, step_fn, first: int, last: int, batch_fn, on_step=None):
    """Steps ``first .. last - 1``; ``on_step(s, state)`` after each."""
    params, opt_state = state["params"], state["opt_state"]
    for s in range(first, last):
        params, opt_state, _ = step_fn(params, opt_state, batch_fn(s))
        if on_step is not None:
            on_step(s, {"params": params, "opt_state": opt_state})
    return {"params": params, "opt_state": opt_state}


def _gather(tree):
    """Every replica's values, on every process, as numpy (a collective)."""
    import jax
    from jax.experimental import multihost_utils

    return jax.tree.map(
        lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree
    )


def _flat(tree, prefix):
    import jax

    return {
        prefix + jax.tree_util.keystr(p): np.asarray(x)
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["train", "resume"])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--processes", type=int, default=CFG["processes"])
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--ckpt-every", type=int, default=0)
    ap.add_argument("--from", dest="resume_from", type=int, nargs="*", default=None)
    ap.add_argument("--mismatch", type=int, nargs=2, default=None)
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds per step (kill test)")
    ap.add_argument("--heartbeat", type=int, default=10)
    args = ap.parse_args(argv)
    pid = args.process_id

    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", CFG["devices_per_process"])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{args.port}",
        args.processes,
        pid,
        initialization_timeout=60,
        heartbeat_timeout_seconds=args.heartbeat,
    )
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import lsgd_jax

    mesh = lsgd_jax.make_mesh()  # defaults: one row (node) per process
    data = NamedSharding(mesh, P(lsgd_jax.data_axes(mesh)))
    step_fn = lsgd_jax.data_parallel_step(loss_fn, make_tx(), mesh)

    def batch_fn(s):
        return jax.make_array_from_process_local_data(data, local_batch(s, pid))

    def log(msg):
        print(f"[process {pid}] {msg}", flush=True)

    info = {"process_index": jax.process_index(), "mesh_shape": dict(mesh.shape)}
    info["mesh_row_is_this_process"] = sorted(d.id for d in mesh.devices[pid]) == sorted(
        d.id for d in jax.local_devices()
    )
    info["other_rows_are_other_processes"] = all(
        d.process_index == r for r, row in enumerate(mesh.devices) for d in row
    )

    def save_final(state, name):
        full = _gather(state)
        np.savez(os.path.join(args.out, f"{name}_p{pid}.npz"), **_flat(full, ""))

    if args.mode == "train":
        traj = []

        def on_step(s, state):
            traj.append(_gather(state["params"]))
            if args.ckpt_every and (s + 1) % args.ckpt_every == 0:
                lsgd_jax.save_checkpoint(args.ckpt, s + 1, state)
            log(f"step {s} done")
            time.sleep(args.sleep)

        t0 = time.perf_counter()
        state = train(fresh_state(mesh), step_fn, 0, CFG["steps"], batch_fn, on_step)
        info["train_seconds"] = time.perf_counter() - t0
        stacked = {k: np.stack([t[k] for t in traj]) for k in traj[0]}
        np.savez(os.path.join(args.out, f"traj_p{pid}.npz"), **stacked)
        # The library's readers on arrays that span processes (collectives: all call).
        info["unreplicate"] = {
            k: np.asarray(v).tolist() for k, v in lsgd_jax.unreplicate(state["params"]).items()
        }
        info["consensus"] = {
            k: np.asarray(v).tolist() for k, v in lsgd_jax.consensus(state["params"]).items()
        }
        info["counters"] = lsgd_jax.assert_replicas_in_sync(state["opt_state"])
        save_final(state, "final")
    else:
        if args.mismatch is not None:
            mine = args.mismatch[0] if pid == 0 else args.mismatch[1]
            t0 = time.perf_counter()
            try:
                lsgd_jax.restore_checkpoint(args.ckpt, fresh_state(mesh), step=mine)
                info["mismatch_error"] = None
            except lsgd_jax.ReplicasOutOfSyncError as e:
                info["mismatch_error"] = str(e)
                info["mismatch_values"] = {k: sorted(v) for k, v in e.values.items()}
            info["mismatch_seconds"] = time.perf_counter() - t0
            log(f"mismatch check: {info['mismatch_error']}")
            # A host-local batch is taken as the global one: the step warns.
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                s0 = fresh_state(mesh)
                step_fn(s0["params"], s0["opt_state"], local_batch(0, pid))
            info["host_batch_warnings"] = [str(w.message) for w in caught]
            # Host-side counters, and trees that differ between processes.
            for name, tree, host in [
                ("host_error", {}, {"data position": 10 + pid}),
                ("structure_error", fresh_state(mesh) if pid else {}, None),
            ]:
                try:
                    lsgd_jax.assert_replicas_in_sync(tree, host_counters=host)
                    info[name] = None
                except lsgd_jax.ReplicasOutOfSyncError as e:
                    info[name] = str(e)
        for k in args.resume_from if args.resume_from else [None]:
            step = k if k is not None else lsgd_jax.latest_checkpoint_step(args.ckpt)
            state = lsgd_jax.restore_checkpoint(args.ckpt, fresh_state(mesh), step=step)
            log(f"restored step {step}")

            def on_step(s, state):
                if args.ckpt_every and (s + 1) % args.ckpt_every == 0:
                    lsgd_jax.save_checkpoint(args.ckpt, s + 1, state)
                log(f"step {s} done")

            state = train(state, step_fn, step, CFG["steps"], batch_fn, on_step)
            save_final(state, f"resumed{k if k is not None else ''}")
            info.setdefault("resumed_from", []).append(step)

    with open(os.path.join(args.out, f"info_p{pid}.json"), "w") as f:
        json.dump(info, f)
    log("finished")
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
