"""What a compiled training step communicates, read off its HLO."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import DATA, linear_loss, mesh_2x4, put, smap, train_step
from jax.sharding import PartitionSpec as P

import lsgd_jax
from lsgd_jax.report._hlo import parse_hlo

PARAM_BYTES = (16 * 8 + 8) * 4  # w: f32[16, 8], b: f32[8]


loss = linear_loss


def report_for(tx, mesh, spec=DATA):
    params = {"w": jnp.ones((16, 8)), "b": jnp.zeros(8)}
    n = mesh.devices.size
    args = (
        lsgd_jax.replicate(params, mesh, spec[0]),
        lsgd_jax.replicate(tx.init(params), mesh, spec[0]),
        put(jnp.ones((n, 4, 16)), mesh, spec),
    )
    step = train_step(tx, mesh, spec)
    return lsgd_jax.communication_report(step, *args), step, args


def summary(report):
    return sorted((c.kind, c.axes, c.bytes, c.conditional) for c in report)


def test_post_local_sgd_step_communicates_only_inside_branches():
    mesh = mesh_2x4()
    tx = optax.chain(
        lsgd_jax.post_local_sgd(10),
        optax.sgd(0.1, momentum=0.9),
        lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(4, warmup_steps=10)),
    )
    report, step, args = report_for(tx, mesh)
    print(report)
    # Exactly three collectives, one variadic all-reduce each: the global gradient mean
    # (before the switch), the node-local gradient mean (after), and the model average.
    # None of them runs unconditionally.
    assert summary(report) == [
        ("all-reduce", ("local",), PARAM_BYTES, True),
        ("all-reduce", ("node", "local"), PARAM_BYTES, True),
        ("all-reduce", ("node", "local"), PARAM_BYTES, True),
    ]
    assert not report.where(conditional=False)
    assert sorted(c.scope for c in report) == [
        "model_averaging",
        "post_localSGD_hook",
        "post_localSGD_hook",
    ]
    # The two gradient means are the two branches of ONE conditional: never both.
    local = report.where(axes=("local",))[0].computation
    text = step.lower(*args).compile().as_text()
    (cond,) = [line for line in text.splitlines() if f"%{local}," in line or f"%{local}}}" in line]
    assert " conditional(" in cond
    others = [c.computation for c in report.where(axes=("node", "local"))]
    assert sum(f"%{c}" in cond for c in others) == 1  # the global one is its sibling


def test_no_gradient_allreduce_after_switch():
    mesh = mesh_2x4()
    tx = optax.chain(
        lsgd_jax.post_local_sgd(10, post_local_gradient_allreduce=False),
        optax.sgd(0.1),
        lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(4, warmup_steps=10)),
    )
    report, _, _ = report_for(tx, mesh)
    assert summary(report) == [
        ("all-reduce", ("node", "local"), PARAM_BYTES, True),
        ("all-reduce", ("node", "local"), PARAM_BYTES, True),
    ]


def test_averaging_arithmetic_sits_inside_the_branch():
    mesh = mesh_2x4()
    tx = lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(4))
    report, step, args = report_for(tx, mesh)
    (avg,) = report
    text = step.lower(*args).compile().as_text()
    comps = _computations(text)
    body = _with_callees(comps, avg.computation)
    assert " add(" in body  # params + updates, inside the branch
    assert " subtract(" in body  # mean - params, inside the branch
    entry = next(v for k, v in comps.items() if k.startswith("ENTRY"))
    assert " subtract(" not in entry


def _computations(text):
    comps, name = {}, None
    for line in text.splitlines():
        if line.endswith("{") and "->" in line:
            name = ("ENTRY " if line.startswith("ENTRY") else "") + line.split()[
                int(line.startswith("ENTRY"))
            ].lstrip("%")
            comps[name] = ""
        elif line.startswith("}"):
            name = None
        elif name:
            comps[name] += line + "\n"
    return comps


def _with_callees(comps, root):
    import re

    out, todo, seen = "", [root], set()
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        out += comps[c]
        todo += re.findall(r"calls=%([\w.\-]+)", comps[c])
    return out


def test_hierarchical_runs_one_level_per_step():
    devices = np.array(jax.devices()).reshape(2, 2, 2)
    mesh = jax.sharding.Mesh(devices, ("pod", "node", "local"))
    spec = P(("pod", "node", "local"))
    averager = lsgd_jax.HierarchicalModelAverager(
        {2: "local", 4: ("node", "local"), 8: ("pod", "node", "local")}, warmup_steps=10
    )
    report, _, _ = report_for(lsgd_jax.model_averaging(averager), mesh, spec)
    assert summary(report) == [
        ("all-reduce", ("local",), PARAM_BYTES, True),
        ("all-reduce", ("node", "local"), PARAM_BYTES, True),
        ("all-reduce", ("pod", "node", "local"), PARAM_BYTES, True),
    ]
    assert len({c.computation for c in report}) == 3  # three branches of one switch


def test_functional_path_under_pmap():
    nodes = lsgd_jax.IndexGroups("i", [[0, 1, 2, 3], [4, 5, 6, 7]])
    state = lsgd_jax.PostLocalSGDState(None, nodes, 3)

    def f(state, g):
        g, state = lsgd_jax.post_localSGD_hook(state, g)
        return state, g

    step = jax.pmap(f, axis_name="i", in_axes=(None, 0), out_axes=(None, 0))
    hlo = step.lower(state, jnp.ones((8, 10))).compile().as_text()
    report = parse_hlo(hlo, num_devices=8)
    assert sorted((c.group_size, c.num_groups, c.conditional) for c in report) == [
        (4, 2, True),
        (8, 1, True),
    ]


def test_plain_data_parallel_is_unconditional():
    mesh = mesh_2x4()

    def body(g):
        return jax.lax.pmean(g, ("node", "local"))

    f = smap(body, mesh, DATA, DATA)
    report = lsgd_jax.communication_report(f, put(jnp.ones((8, 4)), mesh, DATA))
    assert summary(report) == [("all-reduce", ("node", "local"), 16, False)]


@pytest.mark.parametrize(
    "groups, axes",
    [
        ("[2,4]<=[8]", ("local",)),
        ("[4,2]<=[2,4]T(1,0)", ("node",)),
        ("[1,8]<=[8]", ("node", "local")),
        ("{{0,1,2,3},{4,5,6,7}}", ("local",)),
        ("{}", ("node", "local")),
    ],
)
def test_parse_hlo_replica_group_forms(groups, axes):
    mesh = mesh_2x4()
    hlo = f"""HloModule m
%add (a: f32[], b: f32[]) -> f32[] {{
  ROOT %s = f32[] add(%a, %b)
}}
%branch (p: f32[10]) -> f32[10] {{
  ROOT %ar = f32[10]{{0}} all-reduce-start(%p), replica_groups={groups}, to_apply=%add
}}
%other (p: f32[10]) -> f32[10] {{
  ROOT %q = f32[10]{{0}} copy(%p)
}}
ENTRY %main (p: f32[10], c: pred[]) -> f32[10] {{
  %ag = bf16[8,6]{{1,0}} all-gather(%p), replica_groups={groups}, dimensions={{0}}
  %ard = f32[10]{{0}} all-reduce-done(%p)
  ROOT %r = f32[10]{{0}} conditional(%c, %p, %p), true_computation=%branch, false_computation=%other
}}
"""
    report = parse_hlo(hlo, mesh=mesh)
    assert [(c.kind, c.axes, c.conditional) for c in report] == [
        ("all-reduce", axes, True),
        ("all-gather", axes, False),
    ]
    ar, ag = report
    assert ar.bytes == 40 and ag.bytes == 8 * 6 * 2 // ag.group_size
    assert "all-reduce" in str(report) and "yes" in str(report)


def lowered_step_report(tx, mesh, platform):
    """The report of a data_parallel_step lowered for ``platform`` with jax.export."""
    step = lsgd_jax.data_parallel_step(loss, tx, mesh)
    params = {"w": jnp.ones((16, 8)), "b": jnp.zeros(8)}
    args = (
        lsgd_jax.replicate(params, mesh),
        lsgd_jax.replicate(tx.init(params), mesh),
        put(jnp.ones((32, 16)), mesh, DATA),
    )
    return lsgd_jax.communication_report(step, *args, platform=platform)


@pytest.mark.filterwarnings("ignore:HierarchicalModelAverager averages over")  # all collectives
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_the_step_lowers_for_gpu_and_tpu_with_collectives_inside_conditionals(platform):
    mesh = mesh_2x4()
    tx = optax.chain(
        lsgd_jax.post_local_sgd(10),
        optax.adamw(1e-3),
        lsgd_jax.model_averaging(
            lsgd_jax.HierarchicalModelAverager({2: "local", 8: ("node", "local")}, 10)
        ),
    )
    report = lowered_step_report(tx, mesh, platform)
    # Before XLA combines them, there is one all-reduce per leaf. data_parallel_step
    # traces the step once per phase, 2 hook phases x 3 averaging levels (none, "local",
    # global) = 6 branches of one switch: the node-local gradient mean sits in 3 of them,
    # the local-level average in 2; likewise the global ones. All conditional.
    unconditional = report.where(conditional=False)
    assert [(c.axes, c.bytes) for c in unconditional] == [(("node", "local"), 4)]  # the loss
    for axes in [("local",), ("node", "local")]:
        cond = report.where(conditional=True, axes=axes)
        assert sum(c.bytes for c in cond) == (3 + 2) * PARAM_BYTES


def test_lowered_report_reads_single_line_collectives_and_names_their_scope_and_phase():
    # all_to_all / all_gather have no region: their types and location are on their own
    # line (the parser once took them from a later "})" line: wrong bytes), and the
    # location is a #loc alias whose name holds the scope and the phase branch.
    mesh = mesh_2x4()
    averager = lsgd_jax.PeriodicModelAverager(
        2, warmup_steps=10, communication_dtype=jnp.bfloat16, delta=True
    )
    tx = optax.chain(
        lsgd_jax.post_local_sgd(10), optax.sgd(0.1), lsgd_jax.model_averaging(averager)
    )
    report = lowered_step_report(tx, mesh, "cuda")
    # 2 hook phases x (no average, average): the average sits in branches 1 and 3
    sent = [(c.kind, c.bytes, c.scope, c.branch) for c in report if c.kind != "all-reduce"]
    n = PARAM_BYTES // 4  # 136 floats, a multiple of 8: no padding
    assert sorted(sent) == [
        ("all-gather", n * 2 // 8, "model_averaging", 1),
        ("all-gather", n * 2 // 8, "model_averaging", 3),
        ("all-to-all", n * 2, "model_averaging", 1),
        ("all-to-all", n * 2, "model_averaging", 3),
    ]
    hook = report.where(scope="post_localSGD_hook")
    assert {c.branch for c in hook} == {0, 1, 2, 3}
    assert {c.branch for c in hook.where(axes=("node", "local"))} == {2, 3}  # before
    assert [c.scope for c in report.where(conditional=False)] == ["metrics"]


def _ms_loss(p, stats, x):
    """A loss with model state (running means of the batch), as batch norm keeps."""
    out = x @ p["w"] + p["b"]
    return jnp.mean(out**2), {"m": 0.9 * stats["m"] + 0.1 * jnp.mean(out, axis=0)}


@pytest.mark.parametrize(
    "averager",
    [
        lambda: lsgd_jax.HierarchicalModelAverager({2: "local", 4: ("node", "local")}, 4),
        lambda: lsgd_jax.PeriodicModelAverager(2, 4, communication=lsgd_jax.comm.quantized(4)),
        lambda: lsgd_jax.PeriodicModelAverager(2, 4, delay=1, nonfinite="skip"),
    ],
    ids=["hierarchical", "quantized", "delayed-skip"],
)
def test_a_phase_program_holds_no_collective_under_a_conditional(averager):
    """XLA:CPU may start a collective that follows a conditional before the one inside
    it on some devices and not others: with every worker thread waiting in one of the
    two, the step deadlocks (CI: 5 devices in the metrics' global mean, 3 in their
    node's model-state mean). A phase program is straight-line, model state included."""
    mesh = mesh_2x4()
    tx = optax.chain(
        lsgd_jax.post_local_sgd(4, post_local_gradient_allreduce=False),
        optax.sgd(0.1, momentum=0.9),
        lsgd_jax.model_averaging(averager()),
    )
    params = {"w": jnp.ones((16, 8)), "b": jnp.zeros(8)}
    step = lsgd_jax.data_parallel_step(_ms_loss, tx, mesh, with_model_state=True)
    args = (
        lsgd_jax.replicate(params, mesh),
        lsgd_jax.replicate({"m": jnp.zeros(8)}, mesh),
        lsgd_jax.replicate(tx.init(params), mesh),
        jnp.ones((32, 16)),
    )
    programs = step.programs_of(*args, num_steps=10)
    assert len(programs) >= 3
    for mode, compiled in programs:
        report = parse_hlo(compiled.as_text(), mesh)
        assert [c for c in report if c.conditional] == [], mode
    scopes = [c.scope for _, p in programs for c in parse_hlo(p.as_text(), mesh)]
    assert any("model_state_averaging" in s for s in scopes)  # it is there (combined)
