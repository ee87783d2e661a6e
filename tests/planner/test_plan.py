"""lsgd_jax.plan: the link fitted from timed all-reduces, each candidate's step predicted
from its compiled programs' bytes, the fastest within the tolerance chosen (a fake link
and fake timings: deterministic)."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import ROOT, mesh_2x4

import lsgd_jax
from lsgd_jax.planner import CANDIDATES, Link, _plan, fit, measure_link, plan

N = 4096  # params of the test model


def loss_fn(p, b):
    return jnp.mean((b @ p) ** 2)


def inputs():
    return loss_fn, jnp.zeros(N), jnp.ones((8, N))


def test_the_fit_recovers_a_link_and_refuses_timings_it_cannot_tell_apart():
    sizes = [1e3, 1e5, 1e6, 8e6]
    link = fit(sizes, [0.002 + b / 12.5e6 for b in sizes])
    assert link.bytes_per_s == pytest.approx(12.5e6) and link.latency_s == pytest.approx(0.002)
    assert link.seconds(12.5e6, collectives=3) == pytest.approx(1.006)
    with pytest.raises(ValueError, match="two or more different sizes"):
        fit([1e3, 1e3], [0.1, 0.2])
    with pytest.raises(ValueError, match="do not grow with the bytes"):
        fit([1e3, 1e6], [0.2, 0.1])
    with pytest.raises(ValueError, match="bytes_per_s must be > 0"):
        Link(0, 0.001)


def test_the_probe_times_all_reduces_over_the_node_axis_and_fits_them():
    """A fake clock makes each timed all-reduce last latency + bytes / rate, with the
    bytes a ring puts on the link between 2 nodes: 4 groups (one per device of a node),
    2 hops each, 4 bytes a value (independent of the ledger's counting)."""
    mesh = mesh_2x4()
    sizes, rate, latency = (1 << 10, 1 << 14, 1 << 18), 1e9, 5e-4
    ticks = []
    for n in sizes:
        for _ in range(3):
            ticks += [0.0, latency + 32 * n / rate]
    clock = iter(ticks).__next__
    link, rows = measure_link(mesh, sizes=sizes, repeats=3, clock=clock)
    assert [r["link_bytes"] for r in rows] == [32 * n for n in sizes]
    assert link.bytes_per_s == pytest.approx(rate) and link.latency_s == pytest.approx(latency)
    with pytest.raises(ValueError, match="node_axis='nodes' is not an axis"):
        measure_link(mesh, node_axis="nodes")
    # one flat all-reduce over all 8 devices: its ring crosses the 2 nodes at 2 hops,
    # each carrying 2 * 7/8 of the 4-byte values
    clock = iter([0.0, 0.01, 0.0, 0.02] * 3).__next__
    _, flat = measure_link(mesh, sizes=sizes[:2], repeats=1, clock=clock, axes=("node", "local"))
    assert [r["link_bytes"] for r in flat] == [2 * 2 * 7 / 8 * 4 * n for n in sizes[:2]]
    with pytest.raises(ValueError, match="include the node axis 'node'"):
        measure_link(mesh, axes=("local",))
    # like=: one more all-reduce, of the tree's leaf sizes together (a gradient mean's
    # operands); timed once when its first run takes longer than 10 s
    tree = {"a": jnp.zeros(100), "b": jnp.zeros((3, 4))}
    ticks = [0.0, 0.01] * 2 + [0.0, 6.0] + [0.0, 5.0]  # size 1 twice; the tree: 6 s, then 1 run
    _, rows = measure_link(mesh, sizes=(1,), repeats=2, clock=iter(ticks).__next__,
                           axes=("node", "local"), like=tree)  # fmt: skip
    assert [(r["values"], r["link_bytes"], r["seconds"]) for r in rows] == [
        (1, 14, 0.01), (112, 2 * 2 * 7 / 8 * 4 * 112, 5.0)
    ]  # fmt: skip
    with pytest.raises(ValueError, match="like= must be a tree of arrays"):
        measure_link(mesh, like={})
    # a slow link: the sizes stop growing once a run takes longer than max_s
    slow = iter([0.0, 0.2] * 2 + [0.0, 0.9] * 2 + [0.0, 99.0] * 2).__next__
    link, rows = measure_link(mesh, sizes=sizes, repeats=2, max_s=0.5, clock=slow)
    assert [r["values"] for r in rows] == list(sizes[:2])


SLOW_LINK = Link(12.5e6, 0.001)  # 100 Mbit/s, 1 ms a collective


def planned(tolerance, link=SLOW_LINK, compute_s=0.01, num_steps=300, **kwargs):
    loss, params, batch = inputs()
    return plan(loss, params, batch, mesh_2x4(), optax.sgd(0.1), num_steps=num_steps,
                tolerance=tolerance, link=link, compute_s=compute_s, **kwargs)  # fmt: skip


def test_each_step_is_predicted_from_the_bytes_of_its_program():
    found = planned(0.05)
    rows = {r.name: r for r in found.rows}
    ddp = rows["DDP"]
    # DDP: one flat all-reduce a step, the gradients' (XLA adds the loss's mean to it):
    # a ring over 8 devices in 2 nodes, whose 2 node-crossing hops carry 2 * 7/8 * 16 KiB
    grads = 2 * 2 * 7 / 8 * 4 * N
    assert ddp.link_bytes / 300 == pytest.approx(grads, rel=0.01)
    # compute_s is a step without the link; each collective across nodes adds a latency
    # and its bytes: DDP's one (the loss mean rides in it), the 4-bit mean's three
    assert ddp.step_s == pytest.approx(0.01 + 0.001 + grads / 12.5e6, rel=0.01)
    four = rows["DDP, 4-bit two-level gradient means"]
    assert four.step_s == pytest.approx(0.01 + 3 * 0.001 + four.link_bytes / 300 / 12.5e6, rel=0.01)
    # a flat all-reduce over every device (DDP's; the loss mean) goes at the flat link's
    # latency and rate, the 4-bit mean's all-gathers over the node axis at the node link's
    flat = planned(0.05, flat_link=Link(6.25e6, 0.01))
    with_flat = {r.name: r for r in flat.rows}
    assert with_flat["DDP"].step_s == pytest.approx(0.01 + 0.01 + grads / 6.25e6, rel=0.01)
    assert with_flat["DDP, 4-bit two-level gradient means"].step_s == pytest.approx(
        0.01 + 0.01 + 2 * 0.001 + four.link_bytes / 300 / 12.5e6, rel=0.01
    )
    with pytest.raises(TypeError, match="flat_link must be a lsgd_jax.planner.Link"):
        planned(0.05, link=None, flat_link=Link(6.25e6, 0.01))
    # the ranking: those that get within the tolerance by the predicted time they take to
    # (the first reach * 300 steps of the run as predicted step by step), then the others
    within = [r for r in found.rows if r.target_s is not None]
    assert [r.target_s for r in within] == sorted(r.target_s for r in within)
    assert found.rows[: len(within)] == tuple(within) and len(within) >= 3
    assert all(r.risk > 0.05 for r in found.rows[len(within) :])
    for r in within:
        tx = next(c for c in CANDIDATES if c.name == r.name).make(optax.sgd(0.1), 300)
        step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh_2x4())
        p = lsgd_jax.replicate(jnp.zeros(N), mesh_2x4())
        s = lsgd_jax.replicate(tx.init(jnp.zeros(N)), mesh_2x4())
        ledger = lsgd_jax.communication_ledger(step, p, s, jnp.ones((8, N)), num_steps=300)
        seconds = np.cumsum(lsgd_jax.planner.predict(ledger, SLOW_LINK, 0.01))
        assert r.target_s == pytest.approx(seconds[round(r.reach * 300) - 1], rel=0.01)
        assert r.reach == next(c for c in CANDIDATES if c.name == r.name).reach(0.05) < 1
    for r in found.rows:
        assert r.speedup == pytest.approx(ddp.step_s / r.step_s)
        assert r.bytes_ratio == pytest.approx(ddp.link_bytes / r.link_bytes)
    assert rows["DDP, 4-bit two-level gradient means"].bytes_ratio == pytest.approx(12.4, rel=0.05)


def test_the_fastest_within_the_tolerance_is_chosen_with_its_chain():
    slow = planned(0.05)
    fastest = min(r.target_s for r in slow.rows if r.risk <= 0.05)
    near = [r for r in slow.rows if r.risk <= 0.05 and r.target_s <= fastest * 1.02]
    assert slow.chosen.risk == min(r.risk for r in near) and slow.chosen in near
    assert [line for line in str(slow).splitlines() if "**(chosen)**" in line] == [
        line for line in str(slow).splitlines() if line.startswith(f"| {slow.chosen.name} ")
    ]
    strict = planned(0.01)
    assert strict.chosen.risk <= 0.01
    faster_but_risky = [r for r in strict.rows if r.run_s < strict.chosen.run_s]
    assert faster_but_risky and all(r.risk > 0.01 for r in faster_but_risky)
    assert all(r.target_s is None for r in faster_but_risky)
    assert "| never |" in str(strict).replace(" never |", "| never |")
    assert planned(0.0).chosen.name == "DDP"
    # a setup that ends within the tolerance but gets there late loses to one as fast a
    # step that gets there sooner: the time to the tolerance ranks, not the step
    late = lsgd_jax.planner.Candidate("late", CANDIDATES[2].make, 0.01, "made up", (0.5, 0.01))
    soon = lsgd_jax.planner.Candidate("soon", CANDIDATES[2].make, 0.04, "made up", (0.04, 0.04))
    both = planned(0.05, candidates=[late, soon])
    assert both.chosen.name == "soon" and both.chosen.reach == 0.5
    assert both.choose(0.02).name == "late"
    # the same plan answers for another tolerance by the same rule
    assert slow.choose(0.01).name == strict.chosen.name
    assert strict.choose(0.05).name == slow.chosen.name
    assert slow.choose(0.0).name == "DDP"
    with pytest.raises(ValueError, match="tolerance is nats per byte .*; got -1"):
        slow.choose(-1)
    # on a link that costs nothing every setup takes the compute's time: the lowest risk
    assert planned(0.05, link=Link(1e12, 0.0), compute_s=0.01).chosen.name == "DDP"
    # the chain is ready: the chosen setup's, around the user's optimizer
    assert isinstance(strict.tx, optax.GradientTransformation)
    lsgd_jax.check_configuration(strict.tx.init(jnp.zeros(N)), tx=strict.tx)
    with pytest.raises(ValueError, match="no candidate is within tolerance=0.001"):
        planned(0.001, candidates=CANDIDATES[1:])


def test_the_command_prints_the_plan(tmp_path):
    (tmp_path / "my_job.py").write_text(
        textwrap.dedent(
            """
            import jax.numpy as jnp, optax

            def planner_inputs():
                return {"loss_fn": lambda p, b: jnp.mean((b @ p) ** 2),
                        "params": jnp.zeros(4096), "batch": jnp.ones((8, 4096)),
                        "optimizer": optax.sgd(0.1)}
            """
        )
    )
    env = {
        "PYTHONPATH": f"{tmp_path}:{ROOT}",
        "PJRT_NPROC": "16",
        "PATH": "/usr/bin:/bin",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
    }
    cmd = [sys.executable, "-m", "lsgd_jax.planner", "--setup", "my_job:planner_inputs",
           "--steps", "300", "--nodes", "2", "--devices-per-node", "4", "--tolerance", "0.05",
           "--link-mbit", "100", "--latency-ms", "1", "--compute-ms", "10",
           "--json", str(tmp_path / "plan.json")]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "link: 100.0 Mbit/s, 1.000 ms a collective" in out.stdout
    assert out.stdout.count("**(chosen)**") == 1
    bad = subprocess.run([*cmd[:5], "--steps", "3", "--link-mbit", "100"], capture_output=True,
                         text=True, env=env, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and "--link-mbit and --latency-ms together" in bad.stderr
    written = __import__("json").loads((tmp_path / "plan.json").read_text())
    assert np.isfinite([r["step_s"] for r in written["rows"]]).all()
    assert written["tolerance"] == 0.05 and written["link"] == [12.5e6, 0.001]
    assert written["compute_s"] == 0.01 and "target_s" in written["rows"][0]
    # the compute given: no kind of step timed, each charged the compute given
    assert written["rows"][0]["timed_phases"] == []
    assert set(written["rows"][0]["phase_compute_s"].values()) == {0.01}


def call(**kw):
    """plan() of the test model on a 10-step run over SLOW_LINK, any argument replaced."""
    loss, params, batch = inputs()
    args = {"num_steps": 10, "link": SLOW_LINK, "compute_s": 0.01, **kw}
    where = args.pop("mesh", mesh_2x4()), args.pop("optimizer", optax.sgd(0.1))
    return plan(loss, args.pop("params", params), args.pop("batch", batch), *where, **args)


def test_what_a_user_gets_wrong_is_named_with_the_fix():
    loss, params, batch = inputs()
    mesh = mesh_2x4()

    with pytest.raises(TypeError, match="link must be a lsgd_jax.planner.Link"):
        call(link=(1e7, 1e-3))
    for bad, error in ((-1.0, ValueError), (float("nan"), ValueError), ("0.01", TypeError)):
        with pytest.raises(error, match="compute_s"):
            call(compute_s=bad)
    with pytest.raises(TypeError, match="list or tuple of lsgd_jax.planner.Candidate"):
        call(candidates=CANDIDATES[0])
    odd = lsgd_jax.planner.Candidate("odd", lambda opt, n: None, 0.0, "mine")
    with pytest.raises(TypeError, match="candidate 'odd'.*must return an optax chain"):
        call(candidates=[odd])
    with pytest.raises(ValueError, match="risk"):
        lsgd_jax.planner.Candidate("nan risk", CANDIDATES[0].make, float("nan"), "mine")
    with pytest.raises(ValueError, match="one node along 'node'"):
        call(mesh=lsgd_jax.make_mesh(1, 8))
    with pytest.raises(ValueError, match="one node along 'node'"):
        measure_link(lsgd_jax.make_mesh(1, 8))
    with pytest.raises(ValueError, match="link_bytes and collectives"):
        SLOW_LINK.seconds(-5e6)
    with pytest.raises(TypeError, match="collectives"):
        SLOW_LINK.seconds(5e6, collectives=1.5)
    with pytest.raises(ValueError, match="collectives"):
        SLOW_LINK.seconds(5e6, collectives=-1)
    with pytest.raises(ValueError, match="max_s .* > 0; got -1"):
        measure_link(mesh, max_s=-1)
    # the candidates wrap the inner optimizer: a chain that already averages is named
    with pytest.raises(ValueError, match="pass the inner optimizer alone"):
        call(optimizer=optax.chain(lsgd_jax.post_local_sgd(5), optax.sgd(0.1)))
    with pytest.raises(TypeError, match="optimizer must be an optax GradientTransformation"):
        call(optimizer=optax.sgd)
    # the built-in candidates average over 'local'
    other = jax.sharding.Mesh(mesh.devices, ("dcn", "ici"))
    with pytest.raises(ValueError, match=r"\('dcn', 'local'\)"):
        call(mesh=other, node_axis="dcn")
    # a batch the step would refuse is refused before anything is compiled
    with pytest.raises(ValueError, match="divide by the 8 replicas"):
        call(batch=batch[:6])


def test_without_ddp_among_the_candidates_ddp_is_still_the_reference():
    found = planned(0.05, candidates=CANDIDATES[1:])
    with_ddp = {r.name: r for r in planned(0.05).rows}
    for r in found.rows:
        assert r.speedup == pytest.approx(with_ddp[r.name].speedup)
        assert r.bytes_ratio == pytest.approx(with_ddp[r.name].bytes_ratio)
    # one entry per kind of step: its bytes and collectives name it
    diloco = with_ddp["DiLoCo H=16, 8-bit averages, 4-bit warm-up to 1/15"]
    assert len(diloco.phase_step_s) == 3 and all(" B in " in k for k in diloco.phase_step_s)


def test_the_probe_takes_an_explicit_mesh():
    import jax

    mesh = jax.make_mesh((2, 4), ("node", "local"))  # Explicit axes, jax's default
    # a fake clock: two sizes on a shared CPU can take times the noise reorders
    clock = iter([0.0, 1e-3, 0.0, 1e-2]).__next__
    link, rows = measure_link(mesh, sizes=(1 << 8, 1 << 12), repeats=1, clock=clock)
    assert link.bytes_per_s > 0 and [r["link_bytes"] for r in rows] == [8192, 131072]


def test_the_measured_compute_leaves_out_the_loss_mean_across_nodes(monkeypatch):
    """A local step (timed at 50 ms here) averages its loss across nodes in one flat
    collective: the compute is the step less that collective's predicted time on the
    link measured (here a fake probe's); a link given may not be this mesh's, so
    nothing is taken off then (a 50 ms latency given once left a compute of 0)."""
    import lsgd_jax.planner._compute as plan_module

    monkeypatch.setattr(plan_module, "timed", lambda *args, **kwargs: 0.05)
    monkeypatch.setattr(_plan, "measure_link", lambda *a, **k: (Link(1e12, 0.004), []))
    loss, params, batch = inputs()
    found = plan(loss, params, batch, mesh_2x4(), optax.sgd(0.1), num_steps=30,
                 phase_budget_s=0)  # fmt: skip
    assert found.compute_s == pytest.approx(0.05 - 0.004, abs=1e-9)
    ddp = next(r for r in found.rows if r.name == "DDP")  # one flat collective a step
    assert ddp.step_s == pytest.approx(0.05, abs=1e-6)
    given = plan(loss, params, batch, mesh_2x4(), optax.sgd(0.1), num_steps=30,
                 link=Link(2.5e6, 0.05))  # fmt: skip
    assert given.compute_s == pytest.approx(0.05, abs=1e-9)
    assert "(no kind of step timed: a link or compute given" in str(given)
    for bad in (-0.1, -1e-9):  # a tolerance below 0 is named as such, not as "too strict"
        with pytest.raises(ValueError, match=rf"plan: tolerance is nats per byte.*got {bad}"):
            plan(loss, params, batch, mesh_2x4(), optax.sgd(0.1), num_steps=30,
                 tolerance=bad, link=SLOW_LINK, compute_s=0.01)  # fmt: skip
        with pytest.raises(ValueError, match=rf"Plan.choose: tolerance is nats.*got {bad}"):
            given.choose(bad)


def test_what_the_independent_probe_broke_is_refused_with_the_fix():
    loss, params, batch = inputs()
    mesh = mesh_2x4()

    with pytest.raises(ValueError, match="node_axis='node'"):
        call(node_axis="local")
    three = jax.sharding.Mesh(mesh.devices.reshape(2, 2, 2), ("node", "local", "model"))
    with pytest.raises(ValueError, match="a mesh of two axes"):
        call(mesh=three)
    with pytest.raises(ValueError, match=r"pass node_axis= one of \('dcn', 'ici'\)"):
        call(mesh=jax.sharding.Mesh(mesh.devices, ("dcn", "ici")))
    bad = lsgd_jax.planner.Candidate("bad", lambda opt: opt, 0.0, "mine")
    with pytest.raises(RuntimeError, match=r"candidate 'bad': make\(optimizer, num_steps\)"):
        call(candidates=[bad])
    unmeasured = lsgd_jax.planner.Candidate("mine", CANDIDATES[0].make, None, "mine")
    with pytest.raises(ValueError, match="a risk of None is never chosen"):
        call(candidates=[unmeasured], tolerance=1.0)
    risky = CANDIDATES[-1]  # the user's candidates alone: DDP (risk 0) is only the reference
    with pytest.raises(ValueError, match=f"raise the tolerance to at least {risky.risk}"):
        call(candidates=[risky], tolerance=risky.risk / 2)
    with pytest.raises(ValueError, match="params must be one replica's"):
        call(params=lsgd_jax.replicate(params, mesh))
    with pytest.raises(TypeError, match=r"MultiSteps pass its .gradient_transformation\(\)"):
        call(optimizer=optax.MultiSteps(optax.sgd(0.1), 2))
    found = call(tolerance=0.05)
    assert hash(found) == hash(found) and len({*found.rows}) == len(found.rows)
    assert "+0.0075 (" in str(found)  # the 1/3 warm-up's risk, not rounded past 0.007
    # measure_link: one axis name as a string, distinct axes, sizes smallest first
    clock = iter([0.0, 0.01, 0.0, 0.02]).__next__
    _, rows = measure_link(mesh, sizes=(1, 1024), repeats=1, clock=clock, axes="node")
    assert [r["values"] for r in rows] == [1, 1024]
    with pytest.raises(ValueError, match="distinct axes"):
        measure_link(mesh, axes=("node", "node"))
    for sizes in ((1024,), (8192, 1024), (1024, 1024)):
        with pytest.raises(ValueError, match="two or more different sizes, smallest first"):
            measure_link(mesh, sizes=sizes)
    # an empty leaf sends nothing: left out of like=
    clock = iter([0.0, 0.01, 0.0, 0.1, 0.0, 0.1]).__next__
    _, rows = measure_link(mesh, sizes=(1,), repeats=1, clock=clock, axes=("node", "local"),
                           like={"w": jnp.zeros(3), "e": jnp.zeros((0, 3))})  # fmt: skip
    assert [r["values"] for r in rows] == [1, 3]
    with pytest.raises(ValueError, match="finite and >= 0"):
        fit([1e3, float("nan")], [0.1, 0.2])


def test_predict_checks_what_it_is_given():
    from lsgd_jax.planner import predict

    loss, params, batch = inputs()
    mesh = mesh_2x4()
    tx = CANDIDATES[0].make(optax.sgd(0.1), 4)
    built = lsgd_jax.data_parallel_step(loss, tx, mesh)
    p, s = lsgd_jax.replicate(params, mesh), lsgd_jax.replicate(tx.init(params), mesh)
    ledger = lsgd_jax.communication_ledger(built, p, s, batch, num_steps=4)
    with pytest.raises(TypeError, match="link must be a lsgd_jax.planner.Link"):
        predict(ledger, (1e6, 0.01), 0.01)
    with pytest.raises(TypeError, match="ledger must be a communication_ledger"):
        predict(built, SLOW_LINK, 0.01)
    with pytest.raises(ValueError, match="compute_s is seconds, >= 0"):
        predict(ledger, SLOW_LINK, -1.0)


def test_the_command_names_the_flag_to_fix(tmp_path, monkeypatch, capsys):
    from lsgd_jax.planner.__main__ import main

    (tmp_path / "my_job.py").write_text(
        "import jax.numpy as jnp, optax\n"
        "def planner_inputs():\n"
        "    return {'loss_fn': lambda p, b: jnp.mean((b @ p) ** 2), 'params': jnp.zeros(64),\n"
        "            'batch': jnp.ones((8, 64)), 'optimizer': optax.sgd(0.1)}\n"
        "def needs_an_argument(x):\n"
        "    return {}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    ok = ["--setup", "my_job:planner_inputs", "--steps", "30"]
    cases = [
        (["--setup", "my_job:planner_inputs", "--steps", "0"], "--steps: must be a positive"),
        ([*ok, "--compute-ms", "-1"], "--compute-ms: must be a finite number >= 0"),
        ([*ok, "--link-mbit", "inf", "--latency-ms", "1"], "--link-mbit: must be a finite"),
        ([*ok, "--tolerance", "nan"], "--tolerance: must be a finite number"),
        ([*ok, "--tolerance", "-0.01"], "--tolerance: must be a finite number >= 0"),
        ([*ok, "--phase-budget-s", "-5"], "--phase-budget-s: must be a finite number >= 0"),
        ([*ok, "--json", str(tmp_path)], "give a file in a folder that exists"),
        (["--setup", "nosuch:planner_inputs", "--steps", "30"], "cannot import 'nosuch'"),
        (["--setup", "my_job.py:planner_inputs", "--steps", "30"], "my_job, not my_job.py"),
        (["--setup", "my_job:needs_an_argument", "--steps", "30"], "must take no arguments"),
        (ok, "pass --nodes N of 2 or more"),  # one process: the default mesh has one node
        ([*ok, "--nodes", "3", "--devices-per-node", "4"], "needs 12 devices, but this job"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err, (argv, err)


def test_what_the_probe_of_the_ranking_broke_is_fixed():
    h16 = CANDIDATES[5]
    # a curve whose last point is a rounding above its risk (an np.float32 risk) reaches
    mine = lsgd_jax.planner.Candidate("mine", h16.make, np.float32(0.01), "u", (0.5, 0.1, 0.01))
    assert mine.reach(np.float32(0.01)) == 1.0 and type(mine.reach(0.055)) is float
    found = planned(0.05, candidates=[*CANDIDATES, mine])
    assert found.choose(np.float32(0.01)).name in {"DDP", mine.name, CANDIDATES[2].name}
    # choose(t) answers at t; its error is its own
    strict = found.choose(0.01)
    assert strict.target_s == pytest.approx(strict.to_within(0.01)) != found.chosen.target_s
    with pytest.raises(ValueError, match="^Plan.choose: tolerance is nats per byte"):
        found.choose(-1)
    for bad, error in ((float("nan"), ValueError), (True, TypeError), ("0.1", TypeError)):
        with pytest.raises(error, match="tolerance"):
            mine.reach(bad)
        with pytest.raises(error, match="tolerance"):
            found.rows[0].to_within(bad)
    # names tell the rows apart, and DDP's columns are the built-in DDP's
    with pytest.raises(ValueError, match=r"share the names \['DDP'\]"):
        planned(0.05, candidates=[CANDIDATES[0], CANDIDATES[0]])
    fake = lsgd_jax.planner.Candidate("DDP", h16.make, h16.risk, "u", h16.curve)
    (row,) = planned(0.05, candidates=[fake]).rows
    assert row.speedup > 1.05 and row.bytes_ratio > 10
    # a run of two steps still shows its times (not "0.0"), a tiny bytes ratio its digits
    tiny = str(planned(0.05, num_steps=2))
    assert "| 0.0 (" not in tiny and "| 0.0 |" not in tiny
    # a run of 1,001 steps: the time to a share is the share of a constant step's run
    ddp = planned(0.05, num_steps=1001, candidates=[CANDIDATES[0]]).rows[0]
    assert ddp.target_s == pytest.approx(ddp.reach * ddp.run_s, rel=1e-9)


def test_a_flat_probe_too_fast_to_fit_is_timed_again_with_a_larger_size(monkeypatch):
    from lsgd_jax.planner import _plan

    calls = []

    def fake(mesh, *, node_axis, axes=None, sizes=(1, 1024), like=None):
        calls.append(tuple(sizes))
        if axes is not None and tuple(sizes) == (1,):  # the params' all-reduce as fast as 1
            raise ValueError("the timings do not grow with the bytes")
        return Link(12.5e6, 0.001), [{"values": 1, "link_bytes": 8, "seconds": 0.001}]

    monkeypatch.setattr(_plan, "measure_link", fake)
    link, flat, probe = _plan._links(mesh_2x4(), "node", None, None, jnp.zeros(N))
    assert calls == [(1, 1024), (1,), (1, 1 << 18)] and flat == Link(12.5e6, 0.001)
