"""One state protocol: each field of the hook's and the averagers' states says its role
where it is declared, and whatever handles states in general asks for roles (issue 28)."""

import ast
import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import isinstance_sites

import lsgd_jax
from lsgd_jax._core import _state_protocol as sp
from lsgd_jax.averaging import _offload
from lsgd_jax.checkpoint import _checkpoint_config, _resize

ROOT = pathlib.Path(__file__).resolve().parents[2] / "lsgd_jax"
STATES = (lsgd_jax.PostLocalSGDState, lsgd_jax.ModelAveragerState)
PARAMS = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}


def full_chain():
    """A chain whose states use every role: an EF residual, the anchor and the outer
    optimizer's state and count, a delay's buffers, a non-finite policy's flag."""
    return optax.chain(
        lsgd_jax.post_local_sgd(4, communication=lsgd_jax.comm.quantized(8)),
        optax.adam(1e-3),
        lsgd_jax.model_averaging(
            lsgd_jax.PeriodicModelAverager(
                2,
                warmup_steps=4,
                outer_optimizer=optax.sgd(0.7, momentum=0.9),
                delay=1,
                communication=lsgd_jax.comm.finite_only("skip"),
            )
        ),
    )


def test_every_field_declares_one_role():
    for cls in STATES:
        roles = sp.roles(cls)
        assert set(roles.values()) <= sp.ROLES, cls
        assert [f.name for f in dataclasses.fields(cls)] == list(roles)
        for f in dataclasses.fields(cls):  # static metadata exactly for the static roles
            assert f.metadata["static"] == (f.metadata["role"] in sp.STATIC_ROLES), f.name
        assert roles[cls.COUNTER_FIELD] == sp.COUNTER and roles["pinned_phase"] == sp.PIN
    assert sp.names(lsgd_jax.PostLocalSGDState, sp.RESIDUAL) == ("comm_state",)
    assert sp.names(lsgd_jax.ModelAveragerState, sp.FLAG) == ("skipped",)


def test_leaf_roles_follow_the_declarations_at_any_depth():
    state = full_chain().init(PARAMS)
    marks = sp.leaf_roles({"nested": [state], "params": PARAMS})
    leaves = jax.tree.leaves({"nested": [state], "params": PARAMS})
    assert len(marks) == len(leaves)
    hook, _, avg_state = state
    expected = []
    for node in (hook, avg_state):
        for name, role in sp.roles(node).items():
            if role not in sp.STATIC_ROLES:
                expected += [role] * len(jax.tree.leaves(getattr(node, name)))
    adam = len(jax.tree.leaves(state[1]))
    # dict keys sort: "nested" (hook, adam's moments, averager), then "params"
    want = expected[: len(jax.tree.leaves(hook))] + [None] * adam
    want += expected[len(jax.tree.leaves(hook)) :] + [None] * len(jax.tree.leaves(PARAMS))
    assert marks == want
    assert {sp.COUNTER, sp.BUFFER, sp.RESIDUAL, sp.FLAG} <= set(marks)


def test_consumers_ask_for_roles():
    assert set(_offload.BUFFERS) == set(
        sp.names(lsgd_jax.ModelAveragerState, sp.BUFFER, sp.RESIDUAL)
    )
    state = full_chain().init(PARAMS)
    kinds = _resize.roles(state)
    flags = [k for k in kinds if k != "value"]
    assert len(flags) == 1  # the averager's skipped, and nothing else
    counters = lsgd_jax.step_counters(state)
    assert list(counters) == ["[0].iter", "[2].step"]


def test_a_snapshot_keeps_the_counters_as_host_ints_and_nothing_else():
    mesh = lsgd_jax.make_mesh(2, 4)
    state = lsgd_jax.replicate(full_chain().init(PARAMS), mesh)
    for node in sp.states(state):
        snap = node.snapshot()
        for name, role in sp.roles(node).items():
            value = getattr(snap, name)
            if role == sp.COUNTER and getattr(node, name) is not None:
                assert type(value) is int, name
                assert value == int(np.asarray(getattr(node, name))[0])
            elif role not in sp.STATIC_ROLES:
                assert value is None, name
        assert snap.pin(1).pinned_phase == 1 and snap.pin(1).pin(None).pinned_phase is None


# The checkpoint manifest records these strings: a restore compares them with the
# target's. Changing them makes every saved checkpoint warn on restore.
SKELETON = (
    "PyTreeDef((CustomNode(PostLocalSGDState[(None, None, 0, True, "
    "Quantized(bits=8, block_size=64, error_feedback=True, two_level=False, "
    "inner_axis='local'), None)], [*, {'b': *, 'w': *}]), "
    "(CustomNode(namedtuple[ScaleByAdamState], [*, {'b': *, 'w': *}, {'b': *, 'w': "
    "*}]), CustomNode(namedtuple[EmptyState], [])), "
    "CustomNode(ModelAveragerState[(None, None)], [*, {'b': *, 'w': *}, "
    "(CustomNode(namedtuple[TraceState], [{'b': *, 'w': *}]), "
    "CustomNode(namedtuple[EmptyState], [])), *, None, None, {'b': *, 'w': *}, "
    "{'b': *, 'w': *}, *])))"
)


def test_the_checkpoint_format_is_unchanged():
    state = full_chain().init(PARAMS)
    assert _checkpoint_config.skeleton(state) == SKELETON
    config = _checkpoint_config.static_config(state)
    assert list(config) == ["[0]", "[2]"]
    hook = config["[0]"]["fields"]
    assert list(hook) == [
        "process_group",
        "subgroup",
        "start_localSGD_iter",
        "post_local_gradient_allreduce",
        "communication",
    ]
    assert hook["subgroup"] == "None" and hook["start_localSGD_iter"] == "4"
    avg = config["[2]"]["fields"]
    assert avg["averager"] == "PeriodicModelAverager" and avg["averager.delay"] == "1"
    json.dumps(config)  # what the manifest writes


def test_no_state_field_is_named_outside_its_package():
    """Fields that only the states have (the generic ``step``, ``iter`` and ``skipped``
    are other classes' names too) appear only in averaging/, hook/ and the protocol."""
    owned = set()
    for cls in STATES:
        owned |= set(sp.data_names(cls)) - {"step", "iter", "skipped"}
    found = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("averaging", "hook") or rel.name == "_state_protocol.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(node, "attr", None) or getattr(node, "arg", None)
            if isinstance(node, (ast.Attribute, ast.keyword)) and name in owned:
                found.append(f"{rel}:{node.lineno} {name}")
    assert found == []


def test_no_code_outside_the_states_packages_tests_for_a_state_class():
    """Whether a state is the hook's or an averager's is its ``KIND`` (the protocol's),
    so the step's chain checks and phase words hold no ``isinstance`` on the classes."""
    classes = {cls.__name__ for cls in STATES}
    assert isinstance_sites(classes, allowed_folders=("averaging", "hook")) == []


def test_kind_says_hook_or_averager():
    hook, avg = sp.states(full_chain().init(PARAMS))
    assert (hook.KIND, avg.KIND) == (sp.HOOK, sp.AVERAGER)
    assert sp.is_kind(hook, sp.HOOK) and not sp.is_kind(hook, sp.AVERAGER)
    assert not sp.is_kind(PARAMS, sp.HOOK)
    averagers = sp.states(full_chain().init(PARAMS), sp.AVERAGER)
    assert [type(s) for s in averagers] == [lsgd_jax.ModelAveragerState]
