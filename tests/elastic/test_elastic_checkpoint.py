"""lsgd_jax.elastic._elastic_checkpoint: the loop's checkpoint arguments, which steps
are due and which are finalized, and the trees it saves (model state only when the loop
has it). The elastic writer in a run: tests/system/test_elastic_checkpoint.py."""

from __future__ import annotations

import jax.numpy as jnp
import optax
import pytest

import lsgd_jax
from lsgd_jax.elastic import ElasticLoop


@pytest.mark.parametrize(
    "directory,every,error,match",
    [
        (None, 5, ValueError, "checkpoint_every=5 needs checkpoint_dir"),
        ("/tmp/ckpt", None, ValueError, "checkpoint_dir='/tmp/ckpt' needs checkpoint_every"),
        ("/tmp/ckpt", 0, ValueError, "checkpoint_every must be a positive int, got 0"),
        ("/tmp/ckpt", 2.5, TypeError, "checkpoint_every must be a Python int, got 2.5"),
        (7, 5, TypeError, "checkpoint_dir must be a folder path.*got 7"),
        ("", 5, TypeError, "checkpoint_dir must be a folder path.*got ''"),
    ],
)
def test_the_loop_refuses_bad_checkpoint_arguments(directory, every, error, match):
    def loss_fn(params, batch):
        return jnp.sum(params["w"] * batch)

    tx = optax.sgd(0.1)
    with pytest.raises(error, match=match):
        ElasticLoop(
            loss_fn,
            tx,
            {"w": jnp.zeros(2)},
            lambda step, layout: None,
            checkpoint_dir=directory,
            checkpoint_every=every,
        )


def test_the_loop_refuses_a_checkpoint_dir_that_is_a_file(tmp_path):
    from lsgd_jax.elastic import _elastic_checkpoint

    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        _elastic_checkpoint.check_args(tmp_path / "f", 3)
    assert _elastic_checkpoint.check_args(tmp_path / "new", 3) == (str(tmp_path / "new"), 3)


def test_only_finalized_checkpoint_steps_are_listed(tmp_path):
    # A finalized step 2; a save of step 4 that never finished (orbax's temporary
    # folder, and an elastic writer's staging folder, as a writer killed mid-save
    # leaves them); a set-aside damaged step 6 and a stray file: the latest is 2.
    # (The elastic writer itself: tests/system/test_elastic_checkpoint.py.)
    from lsgd_jax.elastic import _elastic_checkpoint

    mesh = lsgd_jax.make_mesh(2, 2)
    params = {"w": jnp.ones(3)}
    state = {"params": lsgd_jax.replicate(params, mesh)}
    assert _elastic_checkpoint.latest_step(tmp_path / "missing") is None
    assert [s for s in range(7) if _elastic_checkpoint.Checkpoints("d", 2).due(s)] == [2, 4, 6]
    lsgd_jax.save_checkpoint(tmp_path, 2, state)
    for partial in ("4.orbax-checkpoint-tmp", ".lsgd-staging-4-1/ckpt/4.orbax-checkpoint-tmp"):
        (tmp_path / partial / "arrays").mkdir(parents=True)
        (tmp_path / partial / "_CHECKPOINT_METADATA").write_text("{")
    (tmp_path / "6.unreadable").mkdir()
    (tmp_path / "notes").write_text("x")
    assert _elastic_checkpoint.latest_step(tmp_path) == 2
    assert lsgd_jax.latest_checkpoint_step(tmp_path) == 2
    assert _elastic_checkpoint.finalized(str(tmp_path), 2)
    assert not _elastic_checkpoint.finalized(str(tmp_path), 4)


def test_checkpoint_trees_carry_model_state_only_when_the_loop_has_it():
    from lsgd_jax.elastic import _elastic_checkpoint as ec

    assert ec.as_dict(("p", "o")) == {"params": "p", "opt_state": "o"}
    assert ec.as_dict(("p", "m", "o")) == {"params": "p", "opt_state": "o", "model_state": "m"}
    assert ec.as_state(ec.as_dict(("p", "m", "o"))) == ("p", "m", "o")
    assert ec.as_state({"params": "p", "opt_state": "o"}) == ("p", "o")
