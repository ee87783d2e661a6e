"""A field added to a state after checkpoints of it were saved (issue 35): declared with
``sp.field(role, default=None, added=True)``, it leaves the tree structure, and so every
saved checkpoint, as it was while it is None, and travels like any field once set.

The trace of such a change: the field in ``averaging/_averager_state.py`` (its
declaration, and its value in ``initial_state``), and its use where the averager reads
it (``averaging/_average_call.py``): two package files. Here a subclass stands in for
the changed class (the same name, as a checkpoint's structure records it)."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lsgd_jax
from lsgd_jax._core import _state_protocol as sp
from lsgd_jax._core._struct import pytree_dataclass
from lsgd_jax.checkpoint import _checkpoint_config


def with_new_field():
    """ModelAveragerState as it would be with a new BUFFER field ``note``."""

    @pytree_dataclass
    @dataclasses.dataclass(frozen=True, eq=False)
    class ModelAveragerState(lsgd_jax.ModelAveragerState):
        note: Any = sp.field(sp.BUFFER, default=None, added=True)

    return ModelAveragerState


def chain():
    return optax.chain(
        lsgd_jax.post_local_sgd(2, communication=lsgd_jax.comm.quantized(8)),
        optax.sgd(0.1),
        lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, delta=True)),
    )


def upgraded(state, cls, **changes):
    """``state`` with its averager's state rebuilt as ``cls`` (the new field None)."""
    hook, sgd, avg = state
    fields = {n: getattr(avg, n) for n in (f.name for f in dataclasses.fields(avg))}
    return hook, sgd, dataclasses.replace(cls(**fields), **changes)


def test_a_none_added_field_keeps_the_checkpoint_structure():
    params = {"w": jnp.ones(4)}
    old = chain().init(params)
    new = upgraded(old, with_new_field())
    assert _checkpoint_config.skeleton(new) == _checkpoint_config.skeleton(old)
    assert jax.tree.structure(new) != jax.tree.structure(upgraded(old, with_new_field(), note=1))
    set_ = upgraded(old, with_new_field(), note={"w": jnp.arange(4.0)})
    back = jax.tree.unflatten(jax.tree.structure(set_), jax.tree.leaves(set_))
    np.testing.assert_array_equal(back[2].note["w"], np.arange(4.0))
    assert sp.roles(back[2])["note"] == sp.BUFFER
    assert jax.tree.unflatten(jax.tree.structure(new), jax.tree.leaves(new))[2].note is None


def test_a_checkpoint_saved_before_the_field_restores_into_the_new_state(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    params = {"w": jnp.arange(4.0)}
    old = chain().init(params)
    lsgd_jax.save_checkpoint(tmp_path, 3, {"params": params, "opt_state": old})
    target = {"params": params, "opt_state": upgraded(old, with_new_field())}
    got = lsgd_jax.restore_checkpoint(tmp_path, target, check_in_sync=False)
    assert type(got["opt_state"][2]).__mro__[1] is lsgd_jax.ModelAveragerState
    assert got["opt_state"][2].note is None
    for a, b in zip(jax.tree.leaves(got["opt_state"]), jax.tree.leaves(old)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_added_field_is_a_data_field_defaulting_to_none():
    with pytest.raises(ValueError, match="default=None"):
        sp.field(sp.BUFFER, added=True)
    with pytest.raises(ValueError, match="data field"):
        sp.field(sp.CONFIG, default=None, added=True)
