"""Processes of tests/system/test_elastic.py's small elastic checks (run as a script: each needs
a fresh JAX backend for lsgd_jax.elastic.initialize).

    python tests/elastic_resume_worker.py PORT [SCENARIO [PROCESSES PROCESS_ID [WHO]]]

Scenarios (2 CPU devices a process; one process unless said):

* ``resume`` (default): run 5 steps, then 5..11 from that state, against 12 in one go;
  prints ``RESULT {json}``.
* ``misuse``: user errors (a loss that raises, a batch of the wrong shape, an
  ``initial_state`` that is not per-replica state of this loop, ``first_step`` without
  a state); prints ``RESULT {json}`` with each one's error and how many attempts ran.
* ``compile``: a first step whose compilation (its trace sleeps 8 s) outlasts
  ``stall_timeout_s=4`` completes (prints ``SURVIVED``); then a step stuck in Python
  is ended by the watchdog (exit code 75).
* ``late`` (with ``lsgd_jax.elastic_coordinator``; 2 processes; ``WHO``: ``first``
  or ``again``): both start (JAX's service waits for every process to connect once);
  process 1 leaves at once; process 0 runs 3 steps alone, forgets that the run ended
  (as if a newcomer had looked before it was recorded), prints ``READY`` and runs
  ``consensus`` until the membership changed. Process 1 started ``again`` then meets
  it there: its ``run(3)`` is healed with it and exits 0 with one line (it has no
  step left to run).
* ``user-error``: ``PROCESSES`` processes; the loss raises ValueError at step 2 (when
  it is traced for local SGD's first step) on process ``WHO`` (or on ``every``
  process); each attempt prints ``ATTEMPT step``.
"""

import json
import sys
import time

import lsgd_jax.elastic as elastic

PORT = sys.argv[1]
SCENARIO = sys.argv[2] if len(sys.argv) > 2 else "resume"
NPROC, PID = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (1, 0)
elastic.initialize(
    f"127.0.0.1:{PORT}", NPROC, PID, num_cpu_devices=2, external_coordinator=SCENARIO == "late"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import lsgd_jax  # noqa: E402

W = np.array([[1.0], [-2.0], [0.5]], np.float32)


def batch_fn(step, layout):
    x = np.random.default_rng(step).standard_normal((4 * layout.devices_per_process, 3))
    return {"x": x.astype(np.float32), "y": (x @ W).astype(np.float32)}


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def make_tx():
    return optax.chain(
        lsgd_jax.post_local_sgd(2),
        optax.sgd(0.1, momentum=0.9),
        lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(3, 2)),
    )


def make_loop(loss=loss_fn, batches=batch_fn, **kwargs):
    init = {"w": np.zeros((3, 1), np.float32)}
    return elastic.ElasticLoop(loss, make_tx(), init, batches, **kwargs)


def resume():
    loop = make_loop()
    first = loop.run(5)
    errors = []
    for kwargs in ({}, {"first_step": 12}):
        try:
            loop.run(12, **kwargs)
        except ValueError as e:
            errors.append(str(e))
    rest = loop.run(12, first_step=5, initial_state=(first.params, first.opt_state))
    whole = make_loop().run(12)
    pairs = zip(jax.tree.leaves(rest.opt_state), jax.tree.leaves(whole.opt_state))
    result = {
        "equal": bool(np.array_equal(np.asarray(rest.params["w"]), np.asarray(whole.params["w"]))),
        "steps": [r.step for r in first.records + rest.records],
        "state_equal": all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs),
        "errors": errors,
    }
    print("RESULT", json.dumps(result), flush=True)
    loop.shutdown()


def misuse():
    def bad_loss(params, batch):
        raise ValueError("the loss failed")

    def wide_batches(step, layout):  # 4 features for a (3, 1) weight
        return {"x": np.ones((4 * layout.devices_per_process, 4), np.float32)}

    good = make_loop().run(1)
    one_device = jax.device_put({"w": W}, jax.local_devices()[0])
    adam = lsgd_jax.replicate(optax.adam(0.1).init({"w": W}), good.layout.mesh)
    cases = {
        "loss": ({"loss": bad_loss}, {}),
        "batch": ({"batches": wide_batches}, {}),
        "unreplicated": ({}, {"first_step": 1, "initial_state": (one_device, good.opt_state)}),
        "other_tx": ({}, {"first_step": 1, "initial_state": (good.params, adam)}),
        "first_step": ({}, {"first_step": 2}),
    }
    result = {}
    for name, (loop_kwargs, run_kwargs) in cases.items():
        attempts: list[int] = []
        loop = make_loop(on_attempt=lambda s, layout, a=attempts: a.append(s), **loop_kwargs)
        t0 = time.monotonic()
        try:
            loop.run(5, **run_kwargs)
            error = None
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        result[name] = {"error": error, "attempts": len(attempts), "s": time.monotonic() - t0}
    print("RESULT", json.dumps(result), flush=True)
    elastic.shutdown()


def compile_then_stall():
    traced = []

    def slow_loss(params, batch):
        if not traced:  # a first compile longer than stall_timeout_s
            traced.append(True)
            time.sleep(8.0)
        return loss_fn(params, batch)

    def batches(step, layout):
        if step == 4:  # stuck in Python (heartbeats go on): only the watchdog can tell
            print("STALLING", flush=True)
            time.sleep(10**6)
        return batch_fn(step, layout)

    loop = elastic.ElasticLoop(
        slow_loss, optax.sgd(0.1), {"w": np.zeros((3, 1), np.float32)}, batches,
        stall_timeout_s=4.0,
    )  # fmt: skip
    first = loop.run(3)
    print("SURVIVED", [r.step for r in first.records], flush=True)
    loop.run(8, first_step=3, initial_state=(first.params, first.opt_state))
    print("NOT ENDED BY THE WATCHDOG", flush=True)


def late_consensus():
    from lsgd_jax.elastic import _membership

    if PID == 1 and sys.argv[5] == "first":
        jax.devices()  # the others' backends need this process's devices once
        jax.distributed.shutdown()
        print("LEFT", flush=True)
        return
    loop = make_loop()
    if PID == 1:
        loop.run(3)
        print("NOT ENDED: the late process ran", flush=True)
        return
    result = loop.run(3)
    _membership.client().key_value_delete(_membership.FINISHED)
    print("READY", flush=True)
    deadline = time.monotonic() + 90
    while loop.layout.epoch == 0 and time.monotonic() < deadline:
        loop.consensus(result)
    print("CONSENSUS on", list(loop.layout.processes), "epoch", loop.layout.epoch, flush=True)
    loop.shutdown()


def user_error():
    who, at = sys.argv[5], [0]

    def batches(step, layout):
        at[0] = step
        return batch_fn(step, layout)

    def loss(params, batch):  # traced at steps 0 and 2 (a new phase: local SGD)
        if at[0] == 2 and (who == "every" or int(who) == jax.process_index()):
            raise ValueError(f"the loss failed on process {jax.process_index()}")
        return loss_fn(params, batch)

    # The loss raises when traced at step 2: no compiling of coming phases ahead of
    # time, which would trace it earlier (at step 0, on a background thread)
    loop = make_loop(
        loss,
        batches,
        on_attempt=lambda s, layout: print("ATTEMPT", s, flush=True),
        step_options={"compile_ahead": 0},
    )
    loop.run(4)
    print("FINISHED", flush=True)


{
    "resume": resume,
    "misuse": misuse,
    "compile": compile_then_stall,
    "user-error": user_error,
    "late": late_consensus,
}[SCENARIO]()
