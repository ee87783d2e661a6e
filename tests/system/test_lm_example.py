"""examples/lm.py: a few steps of each method on a tiny model, and its data split.

The runs go in one subprocess with XLA's CPU backend optimizations off, on a model with
no transformer block (embeddings, positions, norm, head: a third of a 1-layer model's
compile time): each method compiles one program per phase (DDP one, post-local SGD
three, DiLoCo with 4-bit delayed averages four), and compiling dominates at these sizes.
The transformer itself is checked apart (shapes, size, causality).
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from helpers import ROOT, load_example

STEPS, START, H = 12, 4, 4
RUNS = f"ddp,local{H},diloco{H}:bits4:delay1"


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("lm") / "records.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    cmd = [sys.executable, str(ROOT / "examples" / "lm.py"), "--quick", "--no-progress"]
    cmd += ["--steps", str(STEPS), "--start", str(START), "--layers", "0"]
    cmd += ["--compare", RUNS, "--json", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    assert [x["method"] for x in lines] == RUNS.split(",")  # one JSON line per run
    return {r["method"]: r for r in json.loads(out.read_text())}


def test_every_method_learns(records):
    for name, r in records.items():
        h = r["history"]
        assert len(h["loss"]) == STEPS and h["eval_step"] == [0, 4, 8, 12]
        assert np.isfinite(h["loss"]).all(), name
        # ln 256 = 5.55 nats at the start; the loss falls over the 12 steps
        assert np.mean(h["loss"][-3:]) < np.mean(h["loss"][:3]) - 0.2, (name, h["loss"])
        assert h["val_loss"][-1] < h["val_loss"][0] - 0.2, (name, h["val_loss"])


def test_ddp_and_local_agree_before_the_switch(records):
    ddp, local = records["ddp"]["history"], records[f"local{H}"]["history"]
    # Gradients averaged over all replicas: the same numbers, bit for bit, until the
    # switch (the loss of step START is computed on the params the warm-up made).
    assert ddp["loss"][: START + 1] == local["loss"][: START + 1]
    assert ddp["val_loss"][:2] == local["val_loss"][:2]  # steps 0 and START
    assert ddp["loss"][START + 1 :] != local["loss"][START + 1 :]  # then they part


def test_cross_node_bytes_fall_by_the_period(records):
    def after_switch(r):
        b = r["history"]["cross_node_bytes"]  # cumulative, per device
        return b[-1] - b[START - 1]

    ddp, local = records["ddp"], records[f"local{H}"]
    assert (
        ddp["history"]["cross_node_bytes"][:START] == local["history"]["cross_node_bytes"][:START]
    )
    ratio = after_switch(local) / after_switch(ddp)
    assert abs(ratio - 1 / H) < 0.01, ratio  # an average every H steps; plus the loss
    # 4-bit two-level averages send a fraction of the float32 ones
    assert after_switch(records[f"diloco{H}:bits4:delay1"]) < 0.5 * after_switch(local)
    # emulated time: compute plus bytes over the link; fewer bytes, less link time
    for r in records.values():
        link = r["emulated_s"] - STEPS * r["compute_s_per_step"]
        assert link > 8 * r["cross_node_bytes"] / (r["link_mbit"] * 1e6) - 1e-9
    assert records["ddp"]["params"] == local["params"] > 10_000
    # bytes on the node links (every device together): fewer averages, fewer bits
    quantized = records[f"diloco{H}:bits4:delay1"]
    assert ddp["node_link_bytes"] > local["node_link_bytes"] > quantized["node_link_bytes"] > 0
    for r in records.values():
        assert r["history"]["eval_node_link_bytes"][-1] == r["node_link_bytes"]


def test_split_is_deterministic_and_held_out():
    lm = load_example("lm")
    a, b = lm.load_corpus(0.3), lm.load_corpus(0.3)
    assert a.train_files == b.train_files and a.val_files == b.val_files
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert a.val_files and not set(a.train_files) & set(a.val_files)
    assert all(lm.is_held_out(f) for f in a.val_files)
    assert not any(lm.is_held_out(f) for f in a.train_files)
    assert 0.3e6 <= len(a.train) < 0.3e6 + 2e6 and len(a.val) >= 0.03e6
    stdlib = pathlib.Path(lm.sysconfig.get_paths()["stdlib"])
    assert len(a.train) == sum((stdlib / f).stat().st_size for f in a.train_files)
    windows = lm.validation_windows(a.val, 8, 32)
    assert windows.shape == (8, 33) and windows.max() < 256


def test_transformer_is_causal_and_sized():
    lm = load_example("lm")
    import jax
    from flax import nnx

    default = nnx.eval_shape(lambda: lm.ByteLM(lm.ModelConfig(), rngs=nnx.Rngs(0)))
    size = sum(x.size for x in jax.tree.leaves(nnx.state(default, nnx.Param)))
    assert 450_000 < size < 550_000  # "about 0.5M parameters"
    graphdef, params = lm.init_model(lm.ModelConfig(layers=1, width=16, heads=2, context=8), 0)
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))  # one compile, not one per op
    tokens = np.arange(8, dtype=np.int32)[None] * 7
    changed = tokens.copy()
    changed[0, 5:] = 3  # later bytes must not change the predictions before them
    a, b = np.asarray(forward(params, tokens)), np.asarray(forward(params, changed))
    assert a.shape == (1, 8, 256)
    np.testing.assert_array_equal(a[0, :5], b[0, :5])
    assert not np.allclose(a[0, 5:], b[0, 5:])


def test_method_names():
    lm = load_example("lm")
    assert lm.parse_method("diloco") == lm.Method("diloco", 32)
    assert lm.parse_method("local", period=8, bits=4) == lm.Method("local", 8, 4)
    assert lm.parse_method("local32:bits4:delay1").name == "local32:bits4:delay1"
    with pytest.raises(ValueError, match="unknown method"):
        lm.parse_method("adam")


def test_the_outer_learning_rate_decays_over_the_outer_steps():
    lm = load_example("lm")
    assert lm.outer_options(0.7, 0.9) == {"learning_rate": 0.7, "momentum": 0.9, "nesterov": True}
    decayed = lm.outer_options(0.7, 0.9, (1500, 500, 32))["learning_rate"]
    # ceil(1000 / 32) = 32 outer steps: 0.7 at the first (the switch), 0 after the last
    assert float(decayed(0)) == pytest.approx(0.7) and float(decayed(32)) == 0.0
    assert 0.0 < float(decayed(31)) < 0.01 < float(decayed(16)) < 0.7


def test_the_outer_step_ends_at_a_floor_or_cools_down_into_a_plain_average():
    lm = load_example("lm")
    import jax.numpy as jnp

    floored = lm.outer_options(0.7, 0.9, (1500, 500, 32), floor=0.2)["learning_rate"]
    assert float(floored(0)) == pytest.approx(0.7) and float(floored(32)) == pytest.approx(0.14)
    cool = lm.outer_options(0.7, 0.9, (1500, 500, 32), cooldown=0.25)
    assert (cool["cooldown"], cool["outer_steps"]) == (0.25, 32)
    state = lm.outer_optimizer(cool).init(jnp.zeros(2))
    assert float(state.hyperparams["momentum"]) == pytest.approx(0.9)  # diloco_outer's
    plain = lm.outer_optimizer(lm.outer_options(0.7, 0.9)).init(jnp.zeros(2))
    assert not hasattr(plain, "hyperparams")  # no schedule: optax.sgd itself


def test_the_slow_link_recipe_builds_the_measured_chain():
    """--recipe slow-link: the flags of issue 29's winning runs (RESULTS.md part 8),
    later flags overriding them, and the chain they build."""
    lm = load_example("lm")
    import jax.numpy as jnp

    args = lm.parse_args(["--recipe", "slow-link", "--seed", "2"])
    assert (args.compare, args.bits, args.warmup_bits, args.start) == ("diloco32", 8, 4, 100)
    assert (args.outer_cooldown, args.outer_decay, args.steps, args.seed) == (0.3, False, 1500, 2)
    assert (args.outer_momentum, args.outer_lr) == (0.8, 0.7)
    method = lm.parse_method(args.compare, args.period, args.bits, args.delay)
    tx = lm.tx_of_args(method, args, lm.outer_of_args(args, method))
    hook, _, averaging = tx.init({"w": jnp.zeros((4, 64))})
    assert (hook.start_localSGD_iter, hook.communication.bits, hook.communication.two_level) == (
        100,
        4,
        True,
    )
    averager = averaging.averager
    assert (averager.period, averager.warmup_steps, averager.communication.bits) == (32, 100, 8)
    outer = averaging.outer_state.hyperparams
    assert float(outer["momentum"]) == pytest.approx(0.8)  # diloco_outer, 44 outer steps
    assert lm.outer_of_args(args, method)["outer_steps"] == 44
    ddp = lm.parse_method("ddp")  # no outer step: the outer options stay plain
    assert lm.outer_of_args(args, ddp) == lm.outer_options(0.7, 0.8)
    # --final-period 12 --final-steps 300: every 12 steps over the last 300, and the
    # cool-down counts those averages (44 at H=24 from 150 to 1182, then 25)
    h24 = ["--recipe", "slow-link", "--compare", "diloco24", "--start", "150"]  # round 9's
    method = lm.parse_method("diloco24", 0, 8, 0)
    final = lm.parse_args([*h24, "--final-period", "12", "--final-steps", "300"])
    assert lm.outer_of_args(final, method)["outer_steps"] == 69
    period = lm.averaging_period(24, 1500, lm.final_of_args(final))
    assert [int(period(s)) for s in (0, 1199, 1200, 1499)] == [24, 24, 12, 12]
    assert lm.averaging_period(24, 1500, None) == 24
    # --qsr: the period grows as the learning rate decays (max(24, QSR / r**2), r the
    # warm-up-and-cosine learning rate over its peak) and the last step averages.
    qsr = lm.averaging_period(24, 1500, None, 1.5, 50)
    r2 = lambda s: (0.5 * (1 + np.cos(np.pi * (s - 50) / 1450))) ** 2  # noqa: E731
    for s in (100, 775, 1000, 1200):
        assert int(qsr(s)) == max(24, int(np.floor(1.5 / r2(s)))), s
    assert int(qsr(1498)) == 2**30 and int(qsr(1499)) == 1
    grown = lm.parse_args([*h24, "--qsr", "1.5"])
    assert lm.outer_of_args(grown, method)["outer_steps"] == 40  # 57 at H=24
    import lsgd_jax

    schedule = lsgd_jax.PeriodicModelAverager(qsr, warmup_steps=150).schedule(1500)
    assert 1499 in np.flatnonzero(schedule) and np.count_nonzero(schedule) == 40
    quick = lm.parse_args(["--recipe", "slow-link", "--quick"])  # CI sizes over the recipe
    assert (quick.steps, quick.start, quick.compare) == (12, 4, "diloco32")


def test_a_quantized_warm_up_quantizes_the_hook_only_and_not_ddp():
    lm = load_example("lm")
    import jax.numpy as jnp

    params = {"w": jnp.zeros((4, 64))}
    kwargs = {"steps": 20, "start": 8, "lr": 1e-3, "warmup": 2, "warmup_bits": 8}
    hook = lm.make_tx(lm.parse_method("diloco"), **kwargs).init(params)[0]
    assert hook.communication.bits == 8 and hook.communication.two_level
    assert hook.comm_state is not None  # error feedback: the residual in the hook's state
    ddp = lm.make_tx(lm.parse_method("ddp"), **kwargs).init(params)[0]
    assert ddp.communication is None and ddp.comm_state is None  # DDP stays the reference
    plain = lm.make_tx(lm.parse_method("diloco"), **{**kwargs, "warmup_bits": 0})
    assert plain.init(params)[0].communication is None


def test_on_gpu_tabulates_the_lines_lm_prints(records):
    # benchmarks/on_gpu.py has never run on a GPU here: its table of examples/lm.py's
    # JSON lines is checked against the lines lm.py really writes.
    import importlib.util

    spec = importlib.util.spec_from_file_location("on_gpu", ROOT / "benchmarks" / "on_gpu.py")
    on_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(on_gpu)
    lines = [json.dumps({k: v for k, v in r.items() if k != "history"}) for r in records.values()]
    table = on_gpu.lm_table("\n".join(["a log line", *lines])).splitlines()
    assert len(table) == 2 + len(records)
    for row, name in zip(table[2:], records):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == name and float(cells[1]) > 0 and float(cells[3]) > 0, row
